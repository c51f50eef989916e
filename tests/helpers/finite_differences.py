"""Central differences of a scalar function of one entry of a parameter, the parameter restored afterwards: the
independent reference for gradients whose value needs an inner solve at every point (EP re-converged per side)."""

import torch


def central_difference(param: torch.Tensor, idx: tuple, h: float, evaluate) -> float:
    """``(evaluate() at param[idx] + h  -  evaluate() at param[idx] - h) / 2h``; ``evaluate`` takes no argument
    and returns a float. ``param`` is changed in place and restored."""
    vals = []
    for sgn in (1, -1):
        with torch.no_grad():
            param[idx] += sgn * h
        vals.append(float(evaluate()))
        with torch.no_grad():
            param[idx] -= sgn * h
    return (vals[0] - vals[1]) / (2 * h)
