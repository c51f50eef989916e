"""List the public classes, functions and methods of pyro_sparsegp whose docstring lacks shapes or a reference to the
paper (equation, section or author) it implements.

    python docs/check_docstrings.py [--all]

A docstring "has shapes" when it writes a tensor shape in the package's style (``[..., B, D]``, ``[M]``, ``()``) or
says that it keeps/broadcasts shapes; it "cites" when it names an equation, a section, an algorithm or one of the
papers' authors. Without ``--all`` only the objects missing something are listed. Methods that override a documented
base-class method (torch.distributions' ``expand``, ``log_prob``, ``sample``, ...; ``forward`` of a documented
PyroModule) inherit that documentation and are skipped; a method is covered by its class's citation, and the
infrastructure modules (``infer.fit``, ``datasets``, ``kernels``, ``linalg``, ``composition``, ``data_stream``,
``validation``) implement no equation, so need none; warnings and errors need no shapes.
The exit status is 0: this is an audit, not a gate.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import pkgutil
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import pyro_sparsegp  # noqa: E402

SHAPE = re.compile(r"``[^`]*\[[^`\]]*\][^`]*``|``\(\)``|\[\.\.\.|shape|broadcast", re.I)
CITE = re.compile(
    r"eq\.|eqs\.|equation|section|algorithm|appendix|Hensman|Titsias|Shi|Wenzel|Polson|Villacampa|Hernández|"
    r"Jaakkola|Salimbeni|Snelson|Matthews|Durante|van der Wilk|Hoffman",
    re.I,
)
# infrastructure that implements no paper equation: shapes are required, a citation is not
TRAINING = "pyro_sparsegp.infer.training."
NO_PAPER = {TRAINING + m for m in ("fit", "batches", "checkpoint", "guard", "distributed", "steps", "progress",
                                   "arguments")} | {
    "pyro_sparsegp.context.reporting", "pyro_sparsegp.checks.inputs", "pyro_sparsegp.datasets",
    "pyro_sparsegp.kernels.batched", "pyro_sparsegp.linalg",
    "pyro_sparsegp.covariances.dispatch", "pyro_sparsegp.inducing.init", "pyro_sparsegp.context.composition",
    "pyro_sparsegp.data_stream", "pyro_sparsegp.checks.validation", "pyro_sparsegp.context.deferred",
    "pyro_sparsegp.deploy.export", "pyro_sparsegp.deploy.reduce", "pyro_sparsegp.deploy.kernels",
    "pyro_sparsegp.deploy.likelihoods",
}
# objects that take or return no tensor: shapes do not apply
NO_TENSORS = {TRAINING + name for name in (
    "checkpoint.FitState", "guard.NonFiniteLossError", "checkpoint.save_checkpoint", "checkpoint.load_checkpoint",
    "batches.EpochBatchSampler.steps_per_epoch", "batches.BatchSource.restart", "distributed.rank_and_world_size",
    "guard.StepGuard.begin", "guard.StepGuard.check", "guard.StepGuard.is_numerical",
    "guard.StepGuard.numerical_failure", "guard.StepGuard.redo", "steps.TrainingStep.clear",
)} | {
    "pyro_sparsegp.infer.natgrad.closed_forms.natgrad_step_for", "pyro_sparsegp.kernels.batched.expected_input_dim",
    "pyro_sparsegp.linalg.CholeskyJitterWarning", "pyro_sparsegp.linalg.default_jitter",
}
INHERITED = {"expand", "log_prob", "sample", "rsample", "mean", "variance", "support", "forward", "cdf", "icdf",
             "entropy", "enumerate_support", "__init__"}


def public_modules():
    names = ["pyro_sparsegp"]
    for info in pkgutil.walk_packages(pyro_sparsegp.__path__, "pyro_sparsegp."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            names.append(info.name)
    return sorted(names)


def objects(mod):
    """``(qualified name, object, docstring of the enclosing class or "")`` of the module's public API."""
    names = getattr(mod, "__all__", None)
    if names is None:
        names = [n for n, o in vars(mod).items()
                 if not n.startswith("_") and getattr(o, "__module__", None) == mod.__name__]
    for name in names:
        obj = getattr(mod, name, None)
        if inspect.ismodule(obj) or getattr(obj, "__module__", None) != mod.__name__:
            continue
        yield f"{mod.__name__}.{name}", obj, ""
        if inspect.isclass(obj):
            for attr, member in vars(obj).items():
                if attr.startswith("_") or attr in INHERITED:
                    continue
                fn = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
                if inspect.isfunction(fn) or isinstance(member, property):
                    yield f"{mod.__name__}.{name}.{attr}", fn, inspect.getdoc(obj) or ""


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--all", action="store_true", help="list every object, not only those missing something")
    args = p.parse_args()
    rows = []
    for name in public_modules():
        mod = importlib.import_module(name)
        for qual, obj, class_doc in objects(mod):
            doc = inspect.getdoc(obj) or ""
            # a method is covered by its class's citation; infrastructure needs none
            cites = bool(CITE.search(doc)) or bool(CITE.search(class_doc)) or name in NO_PAPER
            is_exception = inspect.isclass(obj) and issubclass(obj, BaseException)  # warnings and errors
            shapes = bool(SHAPE.search(doc)) or qual in NO_TENSORS or is_exception
            missing = [what for what, ok in [("docstring", bool(doc)), ("shapes", shapes),
                                              ("citation", cites)] if not ok]
            if missing or args.all:
                rows.append((qual, ", ".join(missing) or "ok"))
    width = max(len(q) for q, _ in rows) if rows else 0
    for qual, what in rows:
        print(f"{qual:{width}s}  {what}")
    print(f"# {sum(what != 'ok' for _, what in rows)} objects missing something")


if __name__ == "__main__":
    main()
