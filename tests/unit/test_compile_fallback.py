"""The way out of a broken compiler toolchain (h3_core.triton_forms): ``compile="off"`` runs the plain path, and a
compiled function or Triton kernel that fails to compile or launch falls back to it once — for the DiT
(``run_options.Evaluations``, through ``generate``), the flex window softmax and the video decoder — said in one
log line naming the cause, with the plain path's results and no retry later. The failures are injected as a
machine without a C compiler raises them: ``torch.compile``'s inductor functions fail with dynamo's
``BackendCompilerFailed``; the hand-written kernels, run by Triton's CPU interpreter, with Triton's
``PTXASError``."""

import itertools
import logging
import textwrap

import pytest
import torch
from tiny_dit import CFG, model, request
from torch._dynamo.exc import BackendCompilerFailed
from torch._inductor.exc import InvalidCxxCompiler
from triton_interpreter import run_interpreted

from h3_core import triton_forms
from h3_core.attention import WindowRun, WindowSpec, window_flex, window_softmax
from h3_core.errors import H3InputError
from h3_core.media import tiling
from h3_core.memory import policy as placement
from h3_core.models import branch_fused, run_options, video_vae
from h3_core.models.video_vae import VideoVAE, VideoVAEConfig
from h3_core.pipeline.generate import generate
from h3_core.pipeline.prompt import PromptEmbedding
from h3_core.pipeline.request import ClipRequest, Runner
from h3_core.triton_forms import COMPILE_MODES


class BrokenToolchain:
    """``torch.compile`` as on a machine without a C++ compiler: what it returns for inductor (the default
    backend) raises ``BackendCompilerFailed`` on every call — for every function, or only for those named in
    ``only`` (the others run as written). Other backends (flex's eager tracing) compile as usual."""

    def __init__(self, real, only=None):
        self.real, self.only, self.compiled, self.calls = real, only, [], 0

    def __call__(self, fn, **kwargs):
        if kwargs.get("backend", "inductor") != "inductor":
            return self.real(fn, **kwargs)
        self.compiled.append(fn)
        if self.only is not None and getattr(fn, "__name__", None) not in self.only:
            return fn

        def broken(*args, **kw):
            self.calls += 1
            raise BackendCompilerFailed(inductor, InvalidCxxCompiler(), None)

        return broken


def inductor(*args):
    """Stands for the backend in the error dynamo raises (it names the backend function)."""


# the line logged names the cause by its type and first line, here dynamo's two (the second names the compiler
# inductor looked for, which differs by machine)
CAUSE = "BackendCompilerFailed: backend='inductor' raised: InvalidCxxCompiler: No working C++ compiler found"


def said_once(caplog, start: str, end: str) -> bool:
    """Exactly one warning, naming the cause: ``start`` (CAUSE) … ``end``."""
    said = warnings_said(caplog)
    return len(said) == 1 and said[0].startswith(start) and said[0].endswith(end)


@pytest.fixture
def fresh(monkeypatch):
    """Nothing compiled and nothing failed yet in this process (the state each module keeps for the process)."""
    monkeypatch.setattr(branch_fused, "_compiled", {})
    monkeypatch.setattr(window_flex, "FLEX", window_flex.FlexKernel())
    monkeypatch.setattr(window_flex, "_masks", window_flex.BoundedLRU(window_flex.MAX_CACHED_MASKS))
    monkeypatch.setattr(video_vae, "_compiled_blocks", {})
    # compiled paths are taken on the CPU as they are on CUDA with Triton
    monkeypatch.setattr(placement, "compiled_branch_available", lambda device: True)
    monkeypatch.setattr(window_flex, "compiles_on", lambda device: True)
    monkeypatch.setattr(tiling, "compiles_on", lambda device: True)


class BlockModes:
    """The ``blocks_fused`` mode each evaluation of ``m`` (each call of the model) and each of its blocks ran in, as
    given with the call (``H3DiT.forward(..., run=)``; a block takes the options as its 6th argument)."""

    def __init__(self, m):
        self.evaluations, self.blocks = [], []
        m.register_forward_pre_hook(lambda model, args, kwargs: self.called(kwargs["run"]), with_kwargs=True)
        for block in m.blocks:
            block.register_forward_pre_hook(lambda block, args: self.blocks[-1].append(args[5].blocks_fused))

    def called(self, run):
        self.evaluations.append(run.blocks_fused)
        self.blocks.append([])

    def clear(self):
        self.evaluations.clear()
        self.blocks.clear()


def broken_toolchain(monkeypatch, only=None) -> BrokenToolchain:
    toolchain = BrokenToolchain(torch.compile, only)
    monkeypatch.setattr(torch, "compile", toolchain)
    return toolchain


def warnings_said(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# ---- the DiT, through generate -----------------------------------------------------------------------


PROMPT = PromptEmbedding(
    torch.randn(4, CFG.text_dim, generator=torch.Generator().manual_seed(3)),
    torch.ones(4, dtype=torch.long),
    features=CFG.text_dim,
)


def sample(m, compile, modes=None, check_cancel=None):
    """A whole generation of the tiny fp64 DiT, set up for the run as the sampler node does (``modes``: gets the
    mode the placement runs the blocks in)."""

    def fit(packed):
        fitted = placement.place_for_run(m, packed, "cpu", placement.RunChoices(compile=compile))
        if modes is not None:
            modes.append(fitted.options.blocks_fused)
        return fitted.options

    with torch.no_grad():
        return generate(
            m,
            PROMPT,
            ClipRequest(frames=22, width=64, height=32, steps=3, seed=5, compile=compile),
            Runner(before_sampling=fit, check_cancel=check_cancel),
        )


@pytest.mark.parametrize("hybrid", [False, True])
# every compiled function failing (the first one called raises), or only the FFN's SwiGLU: its block's
# norms, attention and gated residual have run fused and written in place before it fails
@pytest.mark.parametrize("only", [None, {"swiglu_"}], ids=["all", "swiglu"])
def test_a_failing_compile_falls_back_to_the_plain_path_once(fresh, monkeypatch, caplog, hybrid, only):
    m = model(hybrid)
    toolchain = broken_toolchain(monkeypatch, only)
    modes, ran = [], BlockModes(m)
    plain = sample(m, "off", modes)
    assert toolchain.compiled == [] and modes == [None]  # "off" never calls torch.compile
    assert ran.evaluations == [None] * 3 and all(blocks == [None] * len(m.blocks) for blocks in ran.blocks)
    ran.clear()
    with caplog.at_level(logging.WARNING):
        first = sample(m, "auto", modes)
    assert modes[-1] == "compiled" and toolchain.calls == 1
    assert equal(first, plain)  # bit for bit: the failed evaluation ran again, whole, on the plain path
    assert said_once(caplog, f"the compiled DiT path failed ({CAUSE}", "); this model runs the plain path from now on")
    assert run_options.compile_failed(m)
    # the failed attempt compiled; its rerun and every later evaluation ran the blocks plain
    assert ran.evaluations == ["compiled", None, None, None]
    assert all(blocks == [None] * len(m.blocks) for blocks in ran.blocks[1:])
    ran.clear()
    caplog.clear()
    compiled = len(toolchain.compiled)
    with caplog.at_level(logging.WARNING):
        again = sample(m, "auto", modes)
    assert equal(again, plain) and modes[-1] is None  # plain from the start: no retry, nothing said
    assert ran.evaluations == [None] * 3 and all(blocks == [None] * len(m.blocks) for blocks in ran.blocks)
    assert toolchain.calls == 1 and len(toolchain.compiled) == compiled and warnings_said(caplog) == []


def test_another_model_compiles_afresh(fresh, monkeypatch, caplog):
    failed, other = model(False), model(False)
    broken_toolchain(monkeypatch)
    with caplog.at_level(logging.WARNING):
        sample(failed, "auto")
    assert run_options.compile_failed(failed) and not run_options.compile_failed(other)
    assert failed.compiled_form.failed and not other.compiled_form.failed  # each model holds its own
    assert placement.fuse_for(other, "cpu") == "compiled" and placement.fuse_for(failed, "cpu") is None


def compile_raising(error):
    """``torch.compile`` whose functions raise ``error``."""

    def compile(fn, **kwargs):
        def compiled(*args):
            raise error

        return compiled

    return compile


@pytest.mark.parametrize(
    "error", [torch.OutOfMemoryError("CUDA out of memory"), H3InputError("a bad input")], ids=["oom", "input"]
)
def test_out_of_memory_and_bad_input_are_not_compile_failures(fresh, monkeypatch, caplog, error):
    m = model(True)
    monkeypatch.setattr(torch, "compile", compile_raising(error))
    with caplog.at_level(logging.WARNING), pytest.raises(type(error)):
        sample(m, "auto")
    assert not run_options.compile_failed(m) and warnings_said(caplog) == []


class Interrupted(Exception):
    """A host's cancel exception."""


def test_a_cancel_is_not_a_compile_failure(fresh, monkeypatch, caplog):
    m = model(True)
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)  # compiling works
    calls = itertools.count()

    def check_cancel():  # the user cancels between two blocks of the first evaluation
        if next(calls) == 2:  # before the evaluation, before block 0, before block 1
            raise Interrupted("cancelled")

    with caplog.at_level(logging.WARNING), pytest.raises(Interrupted):
        sample(m, "auto", check_cancel=check_cancel)
    assert not run_options.compile_failed(m) and warnings_said(caplog) == []


def test_a_bad_compile_mode_is_named():
    m = model(False)
    packed, _ = request()
    message = r"compile must be one of \['auto', 'off'\], got 'fast'"
    assert COMPILE_MODES == placement.COMPILE_MODES == ("auto", "off")
    with pytest.raises(H3InputError, match=message):
        placement.fuse_for(m, "cpu", "fast")
    with pytest.raises(H3InputError, match=message):
        placement.place_for_run(m, packed, "cpu", placement.RunChoices(compile="fast"))
    with pytest.raises(H3InputError, match=message):
        generate(m, PROMPT, ClipRequest(frames=22, width=64, height=32, steps=2, seed=5, compile="fast"))
    with pytest.raises(H3InputError, match=message):
        tiling.decode_video(VideoVAE(VideoVAEConfig(**TINY_VAE)), torch.zeros(24, 2, 2, 2), compile="fast")


# ---- the hand-written Triton kernels, under Triton's CPU interpreter ---------------------------------------

CHECK = textwrap.dedent(
    """
    import logging, sys
    sys.path.insert(0, "tests/unit")
    import torch
    compiled = []
    torch.compile = lambda fn, **kwargs: compiled.append(fn) or fn  # the Triton kernels differ, nothing else
    from triton.runtime.errors import PTXASError

    import h3_core.models.fp8_triton as fp8_kernels
    import h3_core.models.block_triton as block_kernels
    import h3_core.models.branch_triton as branch_kernels
    from h3_core.memory import policy as placement
    from h3_core.pipeline.generate import generate
    from h3_core.pipeline.request import ClipRequest, Runner
    from h3_core.pipeline.prompt import PromptEmbedding
    from tiny_dit import fp32_case

    launched = []
    def count(module, name):
        def kernel(*a, _kernel=getattr(module, name), **k):
            launched.append(name)
            if name == "{broken}":
                raise PTXASError("ptxas not found")
            return _kernel(*a, **k)
        setattr(module, name, kernel)
    for module in (fp8_kernels, block_kernels, branch_kernels):
        for name in [n for n in vars(module) if n.endswith("_triton")]:
            count(module, name)
    said = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("h3_core").addHandler(handler)

    placement.compiled_branch_available = lambda device: True
    m, _, _ = fp32_case(True, {fp8})
    launched.clear()  # the fp8 weights' quantisation: the model's making, not its run
    prompt = PromptEmbedding(torch.randn(4, 20, generator=torch.Generator().manual_seed(3)), torch.ones(4).long(),
                             features=20)
    def run(compile):
        fit = lambda packed: placement.place_for_run(m, packed, "cpu", placement.RunChoices(compile=compile)).options
        with torch.no_grad():
            return generate(m, prompt, ClipRequest(frames=22, width=64, height=32, steps=2, seed=5, compile=compile),
                            Runner(before_sampling=fit))

    plain = run("off")
    assert launched == [] and compiled == [] and said == [], (launched, compiled, said)
    first = run("auto")
    # the kernels before the broken one ran and wrote; the broken one was launched once, never again
    assert launched.index("{broken}") > 0 and launched.count("{broken}") == 1, launched
    assert all(torch.equal(a, b) for a, b in zip(first, plain))
    cause = "PTXASError: PTXAS error: ptxas not found"
    assert said == [f"the compiled DiT path failed ({{cause}}); this model runs the plain path from now on"], said
    count_before = len(launched)
    again = run("auto")
    assert len(launched) == count_before and len(said) == 1 and all(torch.equal(a, b) for a, b in zip(again, plain))
    print("OK")
    """
)


# the FFN's SiLU·up (after the block's norms wrote the residual in place), and in fp8 the gated heads'
# quantisation (after the window softmax and the linear branch's kernels)
@pytest.mark.parametrize("fp8, broken", [(False, "swiglu_triton"), (True, "gate_heads_quantize_triton")])
def test_a_failing_triton_kernel_falls_back_to_the_plain_path_once(fp8, broken):
    assert run_interpreted(CHECK.format(fp8=fp8, broken=broken)).split()[-1] == "OK"


# ---- the flex window softmax ----------------------------------------------------------------------------


def flex_inputs():
    packed, _ = request()
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(packed.layout.seq_len, 3, 16, generator=g) for _ in range(3))
    return q, k, v, packed.layout, WindowSpec(1, 3, "both")


# create_block_mask's compiled build fails first; or it compiles and the flex kernel fails
@pytest.mark.parametrize("only", [None, {"flex_attention"}], ids=["mask", "kernel"])
def test_flex_falls_back_to_eager_once(fresh, monkeypatch, caplog, only):
    q, k, v, layout, window = flex_inputs()
    runs = []
    with triton_forms.plain_path():
        plain = window_softmax(q, k, v, layout, window, backend="flex", on_run=runs.append)
    assert runs[-1].kernel == "eager"
    toolchain = broken_toolchain(monkeypatch, only)
    monkeypatch.setattr(window_flex, "_masks", window_flex.BoundedLRU(window_flex.MAX_CACHED_MASKS))
    with caplog.at_level(logging.WARNING):
        out = window_softmax(q, k, v, layout, window, backend="flex", on_run=runs.append)
    assert torch.equal(out, plain) and runs[-1].kernel == "eager" and toolchain.calls == 1
    assert said_once(caplog, f"compiling flex attention failed ({CAUSE}", "); running it eagerly from now on")
    caplog.clear()
    again = window_softmax(q, k, v, layout, window, backend="flex")
    assert torch.equal(again, plain) and toolchain.calls == 1 and warnings_said(caplog) == []


# ---- the video decoder --------------------------------------------------------------------------------------

TINY_VAE = dict(decoder_layers=2, decoder_heads=2, decoder_head_dim=16, block_out_channels=(8,) * 6, norm_groups=4)


def tiny_vae():
    torch.manual_seed(0)
    vae = VideoVAE(VideoVAEConfig(**TINY_VAE)).eval()
    with torch.no_grad():
        for p in vae.parameters():
            p.normal_(0, 0.2)
    return vae


# two windows of 4 tiles, two tiles a batch: four decodes
DECODE = dict(tiling=tiling.Tiling(tile_px=64, overlap_px=32, tiles_per_batch=2))
LATENTS = torch.randn(24, 12, 6, 6, generator=torch.Generator().manual_seed(6))


def test_the_decoder_falls_back_to_eager_blocks_once(fresh, monkeypatch, caplog):
    vae = tiny_vae()
    toolchain = broken_toolchain(monkeypatch)
    plain = tiling.decode_video(vae, LATENTS, compile="off", **DECODE)
    assert toolchain.compiled == []
    with caplog.at_level(logging.WARNING):
        decoded = tiling.decode_video(vae, LATENTS, **DECODE)
    assert torch.equal(decoded, plain) and toolchain.calls == 1
    said = [line for line in warnings_said(caplog) if "px tiles" not in line]  # less the untrained tile size's
    assert len(said) == 1 and said[0].startswith(f"compiling the video decoder's blocks failed ({CAUSE}")
    assert said[0].endswith("); decoding eagerly from now on")
    caplog.clear()
    again = tiling.decode_video(vae, LATENTS, **DECODE)
    assert torch.equal(again, plain) and toolchain.calls == 1
    assert not any("compil" in line for line in warnings_said(caplog))
    # the failure belongs to this VAE: another one tries its compiled blocks afresh
    assert vae.compiled_form.failed and not tiny_vae().compiled_form.failed


# ---- what a run leaves set ------------------------------------------------------------------------------


def configs():
    return torch._dynamo.config.get_config_copy(), torch._inductor.config.get_config_copy()


def test_compiled_runs_leave_no_setting_changed(fresh):
    """Each compiled path that runs on the CPU, compiled for real (inductor's C++ kernels), against its plain
    path; dynamo's and inductor's settings are those from before the run."""
    before = configs()
    m = model(False)
    plain = sample(m, "off")
    modes, ran = [], BlockModes(m)
    fused = sample(m, "auto", modes)
    assert not run_options.compile_failed(m) and modes == ["compiled"]
    assert ran.evaluations == ["compiled"] * 3 and all(blocks == ["compiled"] * len(m.blocks) for blocks in ran.blocks)
    for a, b in zip(fused, plain, strict=True):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()
    q, k, v, layout, window = flex_inputs()
    with triton_forms.plain_path():
        eager = window_softmax(q, k, v, layout, window, backend="flex")
    runs = []
    compiled = window_softmax(q, k, v, layout, window, backend="flex", on_run=runs.append)
    assert runs == [WindowRun("flex", "flex", "triton")] and (compiled - eager).abs().max() <= 1e-5
    vae = tiny_vae()
    decoded = tiling.decode_video(vae, LATENTS, **DECODE)
    assert (decoded - tiling.decode_video(vae, LATENTS, compile="off", **DECODE)).abs().max() <= 1e-5
    assert not vae.compiled_form.failed
    assert configs() == before
