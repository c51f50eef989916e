r"""Deployment: a trained model's predictions as a program that runs without Pyro or this package
(``torch.export``, ONNX). ``docs/deployment.md`` is the guide.

``ps.export(model, example_X, what=("mean", "var"))`` returns a :class:`torch.export.ExportedProgram` whose
``module()(X)`` gives the requested moments at ``X`` ``[N, D]`` for any batch size ``N``;
``ps.deploy.export_onnx(model, example_X, path)`` writes the same program as ONNX; ``ps.deploy.predictor`` is the
plain :class:`torch.nn.Module` both are traced from.

Design, and why:

* **Constants once, at export.** Prediction needs the Cholesky factor of the inducing covariance and ``q(u)`` in
  whitened coordinates; the strategy computes them in eager code
  (:meth:`~pyro_sparsegp.variational.Strategy.predictive_terms`, with the jitter ``predict`` uses) and the program
  holds ``P = Lj^{-1}``, ``m``, ``C C^T - I`` and the kernel's hyperparameters as buffers, so the graph is the kernel
  evaluation and a few matrix products (:mod:`.modules`). SOLVE-GP and ODVGP reduce to the same form over
  ``[Z; O]`` (the joint factor of algorithm 1), an LMC layer mixes its latents' marginals with ``W``.
* **Plain modules, not the library's code.** Tracing ``predict`` itself would carry the value-keyed caches, the
  ``PyroParam`` constraint transforms and the input checks into the graph; the program here references no Pyro or
  ``pyro_sparsegp`` object (its kernels are written in plain torch, :mod:`.kernels`), so ``torch.export.load``
  works in a process that never imports either. The input checks stay in eager code
  (:mod:`pyro_sparsegp.context.deferred`: under a compiler they read nothing back, so a user's own wrapper around
  ``predict`` also exports).
* **Deep GPs with fixed draws.** A deep GP's predictive is a mixture over samples propagated through the hidden
  layers (Salimbeni & Deisenroth 2017, section 3.3). The program bakes ``num_samples`` standard-normal draws per
  hidden layer (``seed``), shared by all points, and returns the mixture's mean and variance: deterministic, and the
  same as ``dgp.predict`` given the same draws. Moment matching was the alternative; it is biased where a hidden
  layer's output is far from Gaussian, which the fixed draws are not.
* **Dynamic batch, fixed dtype.** The batch dimension is symbolic (``dynamic_batch=True``); ``D`` and the dtype are
  those of ``example_X`` and the constants (``dtype=`` casts them, e.g. a float32 program of a float64 model).
* **Clear refusals.** ``PyroSample`` hyperparameters, kernels or mean functions without a plain form,
  convolutional layers and ``y`` moments of likelihoods without closed forms raise ``ValueError`` naming the fix
  (:mod:`.reduce`, :mod:`.likelihoods`). New layer kinds register their reduction with :func:`register_layer`.

ONNX needs ``onnx`` and ``onnxscript`` (and ``onnxruntime`` to run it): imported by :func:`export_onnx` only.
"""

from .export import QUANTITIES, export, export_onnx, predictor
from .kernels import KERNELS
from .likelihoods import SUPPORTED as SUPPORTED_LIKELIHOODS
from .reduce import register_layer

__all__ = ["export", "export_onnx", "predictor", "register_layer", "QUANTITIES", "KERNELS", "SUPPORTED_LIKELIHOODS"]
