"""The entry points: :func:`predictor` (the plain module), :func:`export` (a :class:`torch.export.ExportedProgram`)
and :func:`export_onnx` (an ONNX model through ``torch.onnx.export(..., dynamo=True)``). The design is in the
package docstring (:mod:`pyro_sparsegp.deploy`)."""

from __future__ import annotations

import warnings

import torch
from pyro.nn import PyroModule

from ..layers import DeepGP
from ..layers.conv import ConvLayer, DeepConvGP
from .likelihoods import y_moments
from .modules import DeepPredictor, Predictor
from .reduce import check_exportable, reduce_layer

__all__ = ["predictor", "export", "export_onnx", "QUANTITIES"]

#: What an exported program can return: the moments of ``q(f*)`` and of the predictive of ``y*``.
QUANTITIES = ("mean", "var", "y_mean", "y_var")


def _check_what(what) -> tuple:
    what = (what,) if isinstance(what, str) else tuple(what)
    bad = [w for w in what if w not in QUANTITIES]
    if not what or bad or len(set(what)) != len(what):
        raise ValueError(f"export: what must be distinct names among {QUANTITIES}, got {what!r}")
    return what


def _deep(model, num_samples: int, seed: int):
    if isinstance(model, DeepConvGP) or any(isinstance(layer, ConvLayer) for layer in model.hidden):
        raise ValueError("export: deep convolutional GPs (ConvLayer hidden layers) are not supported yet; predict "
                         "with dgp.predict in eager code")
    check_exportable(model)
    hidden = [reduce_layer(layer) for layer in model.hidden]
    last = reduce_layer(model.last)
    gen = torch.Generator().manual_seed(int(seed))
    dtype = last.m.dtype
    eps = [torch.randn(num_samples, h.m.shape[0], generator=gen, dtype=dtype) for h in hidden]
    return DeepPredictor(hidden, last, eps), model.last.num_outputs is None


def predictor(model, what=("mean", "var"), *, num_samples: int = 100, seed: int = 0,
              dtype: torch.dtype | None = None) -> torch.nn.Module:
    """The plain :class:`torch.nn.Module` that :func:`export` traces: ``forward(X [N, D])`` returns the tuple of
    ``what`` (each ``[N]``, or ``[N, L]`` for ``L`` outputs), from constants computed now (the model may change
    afterwards; the module does not follow it). ``model``: an ``SVGP``, ``SOLVEGP``, ``ODVGP`` (LMC and multi-output
    layers included) or a ``DeepGP`` of them (``num_samples`` fixed draws per hidden layer from ``seed``); ``dtype``
    casts the constants (default: the model's). Raises ``ValueError`` naming what to do for a model that cannot be
    exported."""
    what = _check_what(what)
    if isinstance(model, DeepGP):
        if isinstance(num_samples, bool) or int(num_samples) != num_samples or num_samples < 1:
            raise ValueError(f"export: num_samples must be a positive integer, got {num_samples!r}")
        core, single = _deep(model, int(num_samples), seed)
        deep = True
    else:
        core, single, deep = reduce_layer(model), model.num_outputs is None, False
    lik = model.likelihood
    moments = None
    if "y_mean" in what or "y_var" in what:
        if getattr(lik, "latent_dim", 1) != 1:
            raise ValueError(f"export: {type(lik).__name__} couples {lik.latent_dim} latent functions per point, and "
                             "its y moments have no closed form here; export what=('mean', 'var') of f instead")
        moments = y_moments(lik, core.last.m.dtype if deep else core.m.dtype)
    module = Predictor(core, what, moments, deep=deep, single=single).eval()
    for sub in module.modules():  # each buffer contiguous in storage of its own (torch.export.save packs storages)
        for name, buffer in list(sub.named_buffers(recurse=False)):
            setattr(sub, name, buffer.detach().to(dtype=dtype if buffer.is_floating_point() and dtype else None,
                                                  memory_format=torch.contiguous_format, copy=True))
    return module


def _module(model, what, num_samples, seed, dtype) -> torch.nn.Module:
    """``model``'s :func:`predictor`, or ``model`` itself when it is already a plain module (not a Pyro module: a
    :func:`predictor`, or several of them in one module of your own whose ``forward(X)`` returns a tuple)."""
    if isinstance(model, torch.nn.Module) and not isinstance(model, PyroModule):
        return model.eval() if dtype is None else model.eval().to(dtype)
    return predictor(model, what, num_samples=num_samples, seed=seed, dtype=dtype)


def _example(example_X, module) -> torch.Tensor:
    X = torch.as_tensor(example_X)
    if X.dim() != 2:
        raise ValueError(f"export: example_X must be [N, D] (a batch of inputs), got shape {tuple(X.shape)}")
    dtype = next((b.dtype for b in module.buffers() if b.is_floating_point()), X.dtype)
    return X.to(dtype)


def export(model, example_X, what=("mean", "var"), dynamic_batch: bool = True, *, num_samples: int = 100,
           seed: int = 0, dtype: torch.dtype | None = None) -> torch.export.ExportedProgram:
    """A :class:`torch.export.ExportedProgram` of ``model``'s predictions: ``ep.module()(X)`` with ``X`` ``[N, D]``
    returns the tuple of ``what`` (``"mean"``, ``"var"`` of ``q(f*)``; ``"y_mean"``, ``"y_var"`` of ``y*``), each
    ``[N]`` or ``[N, L]``, equal to ``model.predict`` (``model`` may also be a plain module of :func:`predictor` s;
    a ``DeepGP``: the moments of its predictive mixture with
    ``num_samples`` fixed draws, see :class:`~pyro_sparsegp.deploy.modules.DeepPredictor`). ``example_X`` ``[N, D]``
    fixes ``D`` and the dtype (``dtype``, default the model's); with ``dynamic_batch`` the batch size ``N`` is a
    symbolic dimension, any size at run time. Save it with ``torch.export.save(ep, path)``; ``torch.export.load``
    reads it back in a process that imports torch only."""
    module = _module(model, what, num_samples, seed, dtype)
    X = _example(example_X, module)
    shapes = {"X": {0: torch.export.Dim("batch")}} if dynamic_batch else None
    return torch.export.export(module, (X,), dynamic_shapes=shapes)


def export_onnx(model, example_X, path=None, what=("mean", "var"), *, num_samples: int = 100, seed: int = 0,
                dtype: torch.dtype | None = None, opset_version: int | None = None, optimize: bool = True):
    """``model``'s predictions as an ONNX model through ``torch.onnx.export(..., dynamo=True)`` (needs ``onnx`` and
    ``onnxscript``, imported by torch here only), with a dynamic batch dimension: input ``"X"`` ``[N, D]``, outputs
    named as in ``what`` (a plain module of your own: ``"out0"``, ``"out1"``, ...). Written to ``path`` if given;
    returns the ``torch.onnx.ONNXProgram``. Arguments as :func:`export`; ``model`` may also be a plain module built
    from :func:`predictor` s (several models in one graph). ONNX Runtime runs float64 programs on the CPU as they
    are (``dtype=torch.float32`` for accelerators or smaller files)."""
    module = _module(model, what, num_samples, seed, dtype)
    X = _example(example_X, module)
    names = list(getattr(module, "what", None) or [f"out{i}" for i in range(len(module(X)))])
    kwargs = {} if opset_version is None else {"opset_version": opset_version}
    with warnings.catch_warnings():  # torch's exporter uses its own deprecated pytree API (torch 2.13)
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                                category=FutureWarning)
        program = torch.onnx.export(module, (X,), dynamo=True, dynamic_shapes={"X": {0: torch.export.Dim("batch")}},
                                    input_names=["X"], output_names=names, verbose=False, optimize=optimize,
                                    **kwargs)
    if path is not None:
        program.save(str(path))
    return program
