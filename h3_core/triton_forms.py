"""The compiled paths are optional: the hand-written Triton kernels and the ``torch.compile``d functions.

Each module of hand-written kernels is imported where it is used, guarded: where Triton (or the module) cannot be
imported the caller gets None for it and runs its eager reference instead. They run on CUDA tensors — and on any
tensor under
Triton's CPU interpreter (``TRITON_INTERPRET=1`` when this module is imported), which is how the CPU tests
drive them through the model's own path.

The user's ``compile`` choice (``COMPILE_MODES``): ``"auto"`` compiles where CUDA and Triton are present,
``"off"`` runs the plain path. Inside ``plain_path()`` no hand-written kernel is handed out (``triton_form``
returns None, so every caller takes its eager reference) and ``compiling()`` is False, which the modules that
``torch.compile`` read. A kernel or compiled function wrapped by ``guarded`` that fails to compile or launch
(a missing C compiler or ptxas, an inductor or Triton error) raises ``CompileFailure`` with the error as its
cause, so the caller that owns a whole computation can run it again on the plain path: its ``CompiledForm``
does that, and remembers the failure for as long as it owns the compiled form.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import importlib.util
import logging
import os
import time

import torch

from . import launch_table
from .errors import H3InputError, is_out_of_memory

__all__ = [
    "COMPILE_MODES",
    "CompileFailure",
    "CompiledForm",
    "check_compile",
    "plain_path",
    "compiling",
    "compiles_on",
    "guarded",
    "triton_form",
    "runs_here",
    "COMPILER_MODULES",
    "FA4_MODULES",
    "TRITON_MODULES",
    "import_compilers",
    "launch_once",
    "capability_of",
]

COMPILE_MODES = ("auto", "off")

log = logging.getLogger(__name__)

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_plain: contextvars.ContextVar[bool] = contextvars.ContextVar("h3_plain_path", default=False)


class CompileFailure(RuntimeError):
    """A compiled function or hand-written kernel failed to compile or launch; ``__cause__`` is the error."""

    def describe(self) -> str:
        """The cause as one line: its type and the first line of its message (continued when that line only
        introduces the next, as dynamo's ``backend='inductor' raised:`` does)."""
        cause = self.__cause__
        lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
        text = " ".join(lines[:2]) if len(lines) > 1 and lines[0].endswith(":") else (lines[0] if lines else "")
        return f"{type(cause).__name__}: {text}" if text else type(cause).__name__


class CompiledForm:
    """The fallback of one compiled form, kept by whatever owns that form (a model, a patch, a module's compiled
    function). The owner runs its compiled form where ``tries(allowed)`` says so, inside ``attempt()``: a
    ``CompileFailure`` it raises there is remembered, said once (``failed_said (cause); then_said from now on``) and
    swallowed, and the owner goes on to run the call again as its plain form inside ``plain_path()`` (a failed
    attempt wrote only its own intermediates); every later call is plain."""

    def __init__(self, failed_said: str, then_said: str):
        self.failed_said, self.then_said = failed_said, then_said
        self.failed = False

    def tries(self, allowed: bool = True) -> bool:
        """Whether the compiled form runs now: ``allowed`` and it has not failed before."""
        return allowed and not self.failed

    @contextlib.contextmanager
    def attempt(self):
        """Around the compiled form's call: its ``CompileFailure`` remembered, said once, and not raised."""
        try:
            yield
        except CompileFailure as failure:
            self.failed = True
            log.warning("%s (%s); %s from now on", self.failed_said, failure.describe(), self.then_said)


def check_compile(compile: str) -> str:
    """``compile`` if it is one of ``COMPILE_MODES``; an ``H3InputError`` naming the input otherwise."""
    if compile not in COMPILE_MODES:
        raise H3InputError(f"compile must be one of {list(COMPILE_MODES)}, got {compile!r}")
    return compile


@contextlib.contextmanager
def plain_path(on: bool = True):
    """Within the block (when ``on``), no hand-written kernel and no ``torch.compile``: the plain path."""
    token = _plain.set(_plain.get() or on)
    try:
        yield
    finally:
        _plain.reset(token)


def compiling() -> bool:
    """Whether compiled paths may run here (not inside ``plain_path``)."""
    return not _plain.get()


def compiles_on(device: torch.device | str) -> bool:
    """Whether ``torch.compile`` makes Triton kernels for ``device``: CUDA with Triton importable."""
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return False
    return importlib.util.find_spec("triton") is not None


def _passes_through(exc: BaseException) -> bool:
    """Out of memory (also as the cause a compiler reports) and bad input are the run's own errors."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, (MemoryError, H3InputError, CompileFailure)) or is_out_of_memory(exc):
            return True
        seen.add(id(exc))
        exc = getattr(exc, "inner_exception", None) or exc.__cause__
    return False


def guarded(fn):
    """``fn`` (a compiled function or a hand-written kernel) raising ``CompileFailure`` from whatever it raises
    but out of memory, an ``H3InputError`` or an interrupt: being a compiled path's own call, such an error is
    the toolchain's or the kernel's, not the computation's."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            if _passes_through(exc):
                raise
            raise CompileFailure(f"{getattr(fn, '__name__', fn)} failed to compile or launch") from exc

    return call


def runs_here(t: torch.Tensor) -> bool:
    """Whether the hand-written kernels take ``t``'s device: CUDA, or any device under the interpreter."""
    return t.is_cuda or _INTERPRETED


def triton_form(module, attribute: str, device: torch.device | str):
    """``attribute`` of ``module`` (a module of hand-written kernels, None where it could not be imported),
    ``guarded`` and launched as ``launch_table`` says for ``device``'s architecture; None inside ``plain_path``
    and where that table does not run the kernel."""
    if _plain.get() or module is None:
        return None
    return _launched(module, attribute, capability_of(device))


def capability_of(device: torch.device | str) -> tuple[int, int] | None:
    """``device``'s compute capability; None off CUDA."""
    return _capability(torch.device(device))


@functools.cache
def _capability(device: torch.device) -> tuple[int, int] | None:
    return tuple(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None


@functools.cache
def _launched(module, attribute: str, capability: tuple[int, int] | None):
    arguments = launch_table.launch(attribute, capability)
    if arguments is None:
        return None
    kernel = guarded(getattr(module, attribute))
    return functools.partial(kernel, **arguments) if arguments else kernel


# What the default compiled paths import on a process's first run: Triton's JIT (every fused function of the DiT
# and the decoder has a hand-written kernel on CUDA, so nothing is traced by dynamo or built by inductor there)
# and FA4's interface where it is installed (its kernels' helper libraries register their operators as they load).
# Dynamo and inductor are imported by the paths that use them (the flex backend, a fallback off CUDA kernels).
TRITON_MODULES = ("triton", "triton.runtime.jit")
FA4_MODULES = ("flash_attn.cute.interface",)
COMPILER_MODULES = TRITON_MODULES + FA4_MODULES


def import_compilers(modules: tuple[str, ...] = COMPILER_MODULES) -> dict[str, float | None]:
    """Import ``modules`` now rather than inside a first run: seconds per module, None for one that is not
    installed or does not import here (the compiled paths then fall back as they would have)."""
    seconds = {}
    for name in modules:
        start = time.perf_counter()
        try:
            if importlib.util.find_spec(name.split(".")[0]) is None:
                seconds[name] = None
                continue
            importlib.import_module(name)
        except Exception:
            seconds[name] = None
            continue
        seconds[name] = time.perf_counter() - start
    return seconds


def launch_once(device: torch.device | str = "cuda") -> float | None:
    """Launch one trivial Triton kernel on ``device`` (``first_launch_triton``) so that a process's one-time launch
    work is done now rather than in the first step of its first run: seconds it took, None where Triton does not
    launch here."""
    device = torch.device(device)
    if not (compiles_on(device) or (_INTERPRETED and device.type == "cpu")):
        return None
    start = time.perf_counter()
    try:
        from . import first_launch_triton

        x = torch.zeros(3, device=device)
        first_launch_triton.add_one(x)
        if x.tolist() != [1.0, 1.0, 1.0]:
            raise RuntimeError(f"the first launch returned {x.tolist()}")
    except Exception:  # the compiled paths will meet and report whatever failed here
        return None
    return time.perf_counter() - start
