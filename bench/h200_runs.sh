#!/usr/bin/env bash
# The GPU runs behind bench/results/, in the order they are worth doing, each writing its JSON (and a log)
# under $OUT (default ./out/h200). Name the parts to run; none runs all of them.
#   checks    python -m pytest tests/gpu (every fast path against its fp32/fp64 reference)
#   branch    bench/branch_stages.py (the linear branch stage by stage, plain and fused)
#   fp8       bench/fp8_stages.py (the row quantiser; the FFN's SiLU·up + quantisation; its input's norm +
#             modulation + quantisation and out_proj's softmax gate + quantisation, two passes and one)
#   launches  bench/kernel_launches.py (each hand-written Triton kernel under several launches)
#   block     bench/dit_block.py --profile: plain, the fused branch, every block fused
#   kernels   bench/dit_block.py, the hybrid block fused, bf16 and fp8: sections, peak and the top CUDA kernels
#   memory    bench/block_memory.py (block peaks against the memory model, incl. the branch's frame chunks)
#   step-bf16 bench/dit_step.py: dense H3 and VDN-H3 decomposed and flex in bf16, median of 3, blocks fused
#   step-fp8  bench/dit_step.py: VDN-H3 decomposed and flex with fp8 linears (each step part fits one call;
#             with flash-attn-4 on PYTHONPATH the same commands give the FA4 table)
#   clocks    nvidia-smi dmon (power, temperatures, SM and memory clocks each second) beside one fp8 hybrid
#             block timed ten times and the fp8 model evaluated twice (whether the model's kernels run slower
#             than the block's under sustained load)
#   caps      bench/dit_step.py at 80 and 24 GiB caps (the memory model's plan; expandable segments, so the
#             memory left by building the model at full size on the device goes back)
# Usage: bash bench/h200_runs.sh [checks] [branch] [fp8] [launches] [block] [kernels] [memory] [step-bf16]
#        [step-fp8] [clocks] [caps]
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT:-out/h200}"
mkdir -p "$out"
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(checks branch fp8 launches block kernels memory step-bf16 step-fp8 clocks caps)
run() {  # name, command...
    local name="$1"; shift
    echo "== $name: $*"
    "$@" > "$out/$name.log" 2>&1
    echo "   exit $? ($(tail -1 "$out/$name.log" | cut -c1-160))"
}
for part in "${parts[@]}"; do
    case "$part" in
        checks) run gpu_tests python3 -m pytest -q -p no:warnings tests/gpu ;;
        branch) run branch_stages python3 bench/branch_stages.py --out "$out/branch_stages.json" ;;
        fp8) run fp8_stages python3 bench/fp8_stages.py --out "$out/fp8_stages.json" ;;
        launches) run kernel_launches python3 bench/kernel_launches.py --out "$out/kernel_launches.json" ;;
        block)
            run dit_block_profile python3 bench/dit_block.py --profile --reps 3 --out "$out/dit_block_profile.json"
            run dit_block_fused_branch python3 bench/dit_block.py --profile --reps 3 --fused-branch compiled \
                --out "$out/dit_block_fused_branch.json"
            run dit_block_fused python3 bench/dit_block.py --profile --reps 3 --fused-blocks compiled \
                --out "$out/dit_block_fused.json" ;;
        kernels)
            run dit_block_kernels_bf16 python3 bench/dit_block.py --blocks hybrid --profile --reps 3 --kernels 40 \
                --fused-blocks compiled --out "$out/dit_block_kernels_bf16.json"
            run dit_block_kernels_fp8 python3 bench/dit_block.py --blocks hybrid --fp8 --profile --reps 3 \
                --kernels 40 --fused-blocks compiled --out "$out/dit_block_kernels_fp8.json" ;;
        memory) run block_memory python3 bench/block_memory.py --frames 102 --variants 1:0 2:32768 1:0:10 2:32768:10 \
                --out "$out/block_memory.json" ;;
        step-bf16) run dit_step_bf16 python3 bench/dit_step.py --variants dense-bf16 bf16-decomposed bf16-flex \
                --reps 3 --profile --fused-blocks compiled --out "$out/dit_step_bf16.json" ;;
        step-fp8) run dit_step_fp8 python3 bench/dit_step.py --variants fp8-decomposed fp8-flex --reps 3 --profile \
                --fused-blocks compiled --out "$out/dit_step_fp8.json" ;;
        clocks)
            nvidia-smi dmon -s pc -d 1 -o T > "$out/dmon.txt" 2>&1 &
            dmon=$!
            run dit_block_clocks python3 bench/dit_block.py --blocks hybrid --fp8 --reps 10 --profile \
                --fused-blocks compiled --out "$out/dit_block_clocks.json"
            run dit_step_clocks python3 bench/dit_step.py --variants fp8-decomposed --reps 2 --profile \
                --fused-blocks compiled --out "$out/dit_step_clocks.json"
            kill "$dmon" ;;
        caps)
            export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
            run dit_step_80 python3 bench/dit_step.py --variants bf16-decomposed --cap-gib 80 --reps 3 \
                --fused-blocks compiled --out "$out/dit_step_cap80.json"
            run dit_step_24 python3 bench/dit_step.py --variants fp8-decomposed --cap-gib 24 --reps 1 \
                --fused-blocks compiled --out "$out/dit_step_cap24.json" ;;
        *) echo "unknown part $part (checks branch fp8 launches block kernels memory step-bf16 step-fp8 clocks caps)"
           exit 2 ;;
    esac
done
