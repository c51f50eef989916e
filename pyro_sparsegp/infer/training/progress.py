"""Training progress that suits where it is written to.

* A terminal (``stderr`` is a TTY): a ``tqdm`` bar with the running ELBO estimate, redrawn in place.
* A Jupyter notebook with ``ipywidgets``: tqdm's notebook widget.
* Anything else (a redirected log file, a pipe, CI, a notebook without widgets): plain lines, one every
  ``every`` of the run (5 %) or every ``seconds`` (30 s), whichever comes first, plus the last step, e.g.
  ``fit: step 150/3000 (5%)  elbo -1.234e+03  95.2 steps/s  1.6 s``. No carriage returns: 3,000 steps write 21 lines.

While a bar is shown, Python warnings are written through ``tqdm.write`` (above the bar, on their own lines), so a
warning never lands inside the bar.
"""

from __future__ import annotations

import sys
import time
import warnings

__all__ = ["Progress"]


def _in_notebook_with_widgets() -> bool:
    """Running in a Jupyter kernel (an IPython shell of the kernel's class, not only ``ipykernel`` imported, as a
    test process that runs notebooks has it) with ``ipywidgets`` installed."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    if shell is None or type(shell).__name__ != "ZMQInteractiveShell":
        return False
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return True


def _warnings_recorded() -> bool:
    """A ``warnings.catch_warnings(record=True)`` is active (pytest's, or a user's): its list takes the warnings, so
    the bar must not reroute them."""
    impl = getattr(warnings, "_showwarnmsg_impl", None)
    return getattr(impl, "__module__", "warnings") != "warnings" or warnings.showwarning is not getattr(
        warnings, "_showwarning_orig", warnings.showwarning)


class Progress:
    """Progress of a run of ``total`` steps starting at ``initial``; ``enabled=False`` writes nothing.

    :param str mode: ``"auto"`` (bar on a TTY or a notebook with widgets, else lines), ``"bar"`` or ``"lines"``.
    :param file: the stream (default ``sys.stderr`` at the time of the call).
    :param float every: fraction of the run between two lines (line mode).
    :param float seconds: the most seconds between two lines (line mode).
    :param str metric: the name shown beside the value given to :meth:`update` (``"elbo"``; EP: ``"log Z"``).

    No tensors, so shapes do not apply; reporting only, it implements no paper equation.
    """

    def __init__(self, total: int, initial: int = 0, enabled: bool = True, desc: str = "fit", mode: str = "auto",
                 file=None, every: float = 0.05, seconds: float = 30.0, metric: str = "elbo"):
        if mode not in ("auto", "bar", "lines"):
            raise ValueError(f"mode must be 'auto', 'bar' or 'lines', got {mode!r}")
        self.total, self.step, self.desc, self.enabled = int(total), int(initial), desc, bool(enabled)
        self.metric = metric
        self.file = sys.stderr if file is None else file
        self.every = max(1, int(round(every * max(self.total, 1))))
        self.seconds = float(seconds)
        self._bar, self._old_showwarning = None, None
        self._start = self._last_time = time.perf_counter()
        self._start_step = self._last_step = self.step
        self._elbo = None
        if not self.enabled:
            return
        if mode == "auto":
            tty = bool(getattr(self.file, "isatty", lambda: False)())
            mode = "bar" if tty or _in_notebook_with_widgets() else "lines"
        if mode == "bar":
            self._open_bar()

    def _open_bar(self):
        if _in_notebook_with_widgets() and self.file is sys.stderr:
            from tqdm.notebook import tqdm
        else:
            from tqdm import tqdm
        self._bar = tqdm(total=self.total, initial=self.step, desc=self.desc, file=self.file, dynamic_ncols=True)
        if _warnings_recorded():  # a recorder or another hook already owns the warnings
            return
        self._old_showwarning = warnings.showwarning
        bar_cls, stream = type(self._bar), self.file

        def showwarning(message, category, filename, lineno, file=None, line=None):
            text = warnings.formatwarning(message, category, filename, lineno, line).rstrip("\n")
            bar_cls.write(text, file=stream)

        warnings.showwarning = showwarning

    def update(self, n: int, elbo: float | None = None) -> None:
        """``n`` more steps are done; ``elbo``: the running ELBO estimate to show. Python numbers, not tensors, so
        shapes do not apply."""
        if not self.enabled:
            return
        self.step += n
        self._elbo = elbo if elbo is not None else self._elbo
        if self.step > self.total:  # a total that was an estimate (fit_gfitc's L-BFGS evaluations): never past 100 %
            self.total = self.step
            if self._bar is not None:
                self._bar.total = self.total
        if self._bar is not None:
            self._bar.update(n)
            if elbo is not None:
                self._bar.set_postfix({self.metric: f"{elbo:.4g}"}, refresh=False)
            return
        now = time.perf_counter()
        due = self.step // self.every > self._last_step // self.every or now - self._last_time >= self.seconds
        if due or self.step >= self.total:
            self._line(now)

    def _line(self, now: float) -> None:
        elapsed = now - self._start
        rate = (self.step - self._start_step) / elapsed if elapsed > 0 else float("nan")
        pct = 100.0 * self.step / self.total if self.total else 100.0
        elbo = "" if self._elbo is None else f"  {self.metric} {self._elbo:.4g}"
        print(f"{self.desc}: step {self.step}/{self.total} ({pct:.0f}%){elbo}  {rate:.1f} steps/s  {elapsed:.1f} s",
              file=self.file, flush=True)
        self._last_time, self._last_step = now, self.step

    def close(self) -> None:
        """Close the bar (and give ``warnings.showwarning`` back); in line mode, write the last line if it is not
        written yet. No tensors, so shapes do not apply."""
        bar, self._bar = self._bar, None
        if bar is not None:
            bar.close()
        if self._old_showwarning is not None:
            warnings.showwarning = self._old_showwarning
            self._old_showwarning = None
        if bar is None and self.enabled and self._last_step != self.step:
            self._line(time.perf_counter())
        self.enabled = False
