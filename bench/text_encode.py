"""One prompt's text encoding at the released size, through the pack's own encoder (``h3_core.pipeline.
text_encoder.TextEncoder``, as H3 Text Encode runs it): Qwen3-VL-32B's shapes up to layer 50 (the states H3 reads)
and its vision tower, RANDOM bf16 weights built on the GPU (no 64 GB file fits the machine's disk; timings do not
depend on the values), Qwen's tokenizer from the host's ``qwen25_tokenizer`` with H3's tokens, a prompt of about
300 tokens. Timed resident (every weight on the GPU) and streamed (the decoder layers in host memory, each
visiting the GPU for its own forward): the first encode and the median of ``--reps`` after it.

    python3 bench/text_encode.py --host .host/comfyui-0.3.75 --out text_encode.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))  # the tiny checkpoints
import record
from text_encoder_memory import qwen3vl_config

from h3_core.pipeline.qwen3vl_tokens import qwen3vl_tokenizer
from h3_core.pipeline.text_encoder import CONDITIONING_LAYER, TextEncoder

GiB = 2**30
TOWER = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_position_embeddings=2304)
SENTENCE = (
    "A red fox trots through fresh snow at dawn, its breath misting in the cold air while pale light spills "
    "over the ridge; the crunch of paws on snow, a distant crow and the wind in the pines. "
)


def random_encoder_model(tiny: bool, device: torch.device):
    """The model, truncated after the conditioning layer, random in bf16 on ``device``."""
    from transformers import Qwen3VLForConditionalGeneration

    if tiny:
        from tiny_checkpoints import tiny_qwen3vl

        return tiny_qwen3vl().to(device)
    config = qwen3vl_config(5120, 25600, 64, 8, CONDITIONING_LAYER, TOWER)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: an fp32 copy of 48 GiB would not fit beside it
    try:
        with torch.device("meta"):
            model = Qwen3VLForConditionalGeneration(config)
    finally:
        torch.set_default_dtype(default)
    model.lm_head = torch.nn.Identity()  # H3 reads hidden states; the files carry no head
    model = model.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or ".norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02, generator=generator)
        for name, b in model.named_buffers():
            if "inv_freq" in name:  # the rotary tables, as transformers computes them
                text = config.text_config  # transformers 5 keeps the theta in rope_parameters
                theta = getattr(text, "rope_theta", None) or text.rope_parameters["rope_theta"]
                b.copy_(1.0 / (theta ** (torch.arange(0, b.numel() * 2, 2, device=device).float() / (b.numel() * 2))))
    return model.eval()


def prompt_of(tokenizer, tokens: int) -> str:
    text = ""
    while len(tokenizer(text)["input_ids"]) < tokens:
        text += SENTENCE
    return text


def timed(encoder: TextEncoder, prompt: str, reps: int, cuda: bool) -> dict:
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times = []
    for _ in range(reps + 1):
        sync()
        started = time.perf_counter()
        embedding = encoder.encode(prompt)
        sync()
        times.append(time.perf_counter() - started)
    return dict(
        first_s=times[0],
        median_s=statistics.median(times[1:]),
        times_s=times,
        rows=int(embedding.embeds.shape[0]),
        finite=bool(torch.isfinite(embedding.embeds.float()).all()),
        peak_gib=torch.cuda.max_memory_allocated() / GiB if cuda else None,
    )


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--host",
        type=Path,
        default=ROOT / ".host" / "comfyui-0.3.75",
        help="the ComfyUI folder whose comfy/text_encoders/qwen25_tokenizer is read",
    )
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="the tiny encoder on the CPU: a dry run")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    tokenizer = qwen3vl_tokenizer(args.host / "comfy" / "text_encoders" / "qwen25_tokenizer")
    started = time.perf_counter()
    model = random_encoder_model(args.tiny, device)
    result = dict(
        record.header("text_encode.py", argv),
        build_s=time.perf_counter() - started,
        parameters=sum(p.numel() for p in model.parameters()),
    )
    encoder = TextEncoder(
        model,
        tokenizer,
        layer=CONDITIONING_LAYER if not args.tiny else len(model.model.language_model.layers),
        device=device,
    )
    result["resident_gib"] = encoder.resident_bytes / GiB
    prompt = prompt_of(tokenizer, args.tokens)
    result["prompt_tokens"] = len(tokenizer(prompt)["input_ids"])
    for placement, stream in (("resident", False), ("streamed", True)):
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        encoder.place(device, stream=stream)
        result[placement] = timed(encoder, prompt, args.reps, cuda)
        print(placement, result[placement], flush=True)
    record.write(result, args.out)
    return result


if __name__ == "__main__":
    main()
