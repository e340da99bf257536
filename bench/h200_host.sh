#!/usr/bin/env bash
# The GPU runs of the pack inside its host, each writing a log (and JSON) under $OUT (default ./out/h200_host).
# The host's Python packages that the GPU machine lacks travel as wheels in ignored folders of the checkout
# (.whl_a, .whl_b, .whl_c; comfy-kitchen's wheel, when carried, split in two: .whl_a/kitchen.part.aa and
# .whl_b/kitchen.part.ab) and are installed with --target into $SITE (default /tmp/site), first on PYTHONPATH.
# The host itself travels as .host_gpu/comfyui-0.3.75 (the test host less two tokenizers it never reads here),
# linked as .host when the checkout has none.
#   install   every wheel found in .whl_a .whl_b .whl_c (the kitchen parts joined first) into $SITE, compiled to
#             bytecode as pip does by default (a process's first run then reads .pyc files, as on a user's machine),
#             the carried host copied to /root/comfyui-0.3.75 (COMFYUI_PATH for every later part and call, so the
#             host need not be carried again), and its and the pack's sources compiled too
#   gpu       python -m pytest on every GPU test (tests/gpu) and the single-file text encoder on CUDA
#   checks    python -m pytest on the GPU tests of what the host integration touches (the fused model and its
#             compile fallback, block offload, the VAEs)
#   quant     the GPU tests of comfy-kitchen's formats (the DiT and video VAE kept against dequantised, the
#             quantised text encoders) and the single-file text encoder on CUDA
#   lora      bench/lora_repatch.py: a strength change against a fresh load from a cold page cache, release size
#   mp4       bench/mp4_presets.py: libx264 presets x threads (seconds, MB, PSNR) on a clip built from the photos
#             carried as .photos (written beforehand by bench/mp4_presets.py --extract .photos)
#   host      the host tests (tests/host) with the ComfyUI server on the GPU (H3_COMFY_GPU=1)
#   gpu-and-host  the two side by side (the GPU tests count only their own process's device memory), then alone the
#             host test that fills the device to meet an out-of-memory
#   devices   the host test of a device per model with the server on the GPU: the DiT and the video VAE on cuda:0
#             beside the text encoder and the audio VAE on the CPU
#   multi-gpu on a machine of several GPUs: the NCCL checks (tests/gpu/test_parallel_cuda.py), one GPU's evaluation
#             and every GPU's with plain Ulysses and with the branch split (6 + 2 on 8, 1 + 1 on 2) by
#             bench/dit_step.py --gpus, and the H3 Multi-GPU host tests with the server on the GPUs
#   rank-shares bench/dit_step.py's one rank's share of an evaluation alone on this GPU (--fake-ranks) for the
#             layouts of 2, 4 and 8 GPUs and 8 with the branch split 6 + 2: each rank's peak and its own seconds,
#             beside one GPU's whole evaluation
#   fp8-attention  the fp8 window softmax: nvidia-cudnn-frontend's wheel (carried as .whl_cudnn) installed into
#             $SITE, its GPU tests, bench/fp8_attention.py's calls (errors, milliseconds and kernels) and
#             bench/dit_step.py's fp8-linear evaluation with the exact and the fp8 window softmax, the branch serial
#             and beside it
#   fp8-attention-model  bench/fp8_attention.py's model: a block's, a velocity's and 8 steps' errors (after
#             fp8-attention, on the same machine: about 6 minutes)
#   decode-stage  bench/decode_stage.py: the decode bench's call and the node's decode into an mp4, cool and after
#             80 s of matrix products, with torch's allocator and with cudaMallocAsync (what ComfyUI sets)
#   load      bench/dit_load.py on the files e2e-write wrote: the DiT loader's and the move to the GPU's seconds, each
#             profiled
#   first-calls  bench/first_calls.py: the first calls of the dense attention and the matrix products in new
#             processes, per shape (what a process pays once, what each new shape costs), also after the start
#             thread's work on another thread, and after that thread made the same calls at the same shapes
#   load-phases  bench/dit_load.py --phases on the same files: the straight load's steps and the staged reads' floor,
#             per read-ahead variant (threads:slabs:chunk MiB)
#   e2e-write, e2e-cold, e2e-restart, e2e-restart-t2va, e2e-restart-warm
#             bench/end_to_end.py's phases (write + eval; cold; restart + report; restart without FL2VA + report;
#             restart then warm in one server + report; E2E_REPEAT=N: N such servers, the median reported;
#             E2E_ADD=1: added to the servers of earlier calls)
#             under /root/h3_e2e, each within one 10-minute call, the results gathered there between calls (a copy
#             in $out after each part); the report goes to $out. With E2E_PYSPY=1, py-spy (its wheel carried in
#             .whl_prof) records every server of the part, all threads, 100 samples a second without pausing it:
#             server_<pid>.speedscope.json in $out/pyspy_<part>.tar.gz (bench/thread_timeline.py reads them);
#             with E2E_GC=1, every full garbage collection of every process, timed, in $out/gc_<part>.jsonl
#             (bench/gc_watch); the GPU's clocks, power and throttle reasons every 0.25 s in $out/gpu_<part>.csv, the
#             host's free and cached memory, huge pages, page faults and compaction stalls in $out/host_<part>.csv
#   first-step, first-step-precompile
#             bench/dit_step.py's first evaluation (profiled) in two new processes, the compile cache empty then
#             filled; -precompile with TORCH_CACHING_PRECOMPILE=1 (dynamo's traced frames cached as well)
#   e2e-files, e2e-eval  the write phase alone, the eval phase alone (the files already written)
#   e2e-seed  the results of earlier runs (.e2e_seed/end_to_end_state.json, carried) as the state the phases add to
#   e2e-text  the release-size text encoder's timing (bench/text_encode.py) into the same state
#   e2e-small the T2VA run with the host's budget at 24 GiB (--reserve-vram), its total and torch's peak
#   e2e-quick write, cold (the cold and the warm run) and report in one call, without the evaluation beside
#   desktop   bench/desktop.py on the files e2e-files wrote: the T2VA workflow through a new server per configuration
#             (DESKTOP_CONFIGS, default "none:0 24:64 16:32 12:32": the host's budget in GiB narrowed by --reserve-vram,
#             host memory limited in GiB; an empty compile cache filled first by a server not recorded), results
#             gathered in /root/h3_e2e/desktop_state.json across calls (a copy in $out)
#   fa4-a, fa4-b  FA4 (flash-attn-4 and the CUTLASS DSL) carried in two calls: .fa4_a (the small wheels, among them
#             nvidia-cutlass-dsl-libs-core, which holds the DSL's Python sources, and protobuf, and the first part of
#             nvidia-cutlass-dsl-libs-cu13), then .fa4_b (its second part): joined and installed with --target into
#             $FA4 (default /tmp/fa4) in one pip call (the DSL's wheels share a folder); with H3_FA4=1 every later part
#             runs with it on PYTHONPATH
# Usage: bash bench/h200_host.sh install [checks] [quant] [lora] [mp4] [host] [e2e-write] [load] [e2e-text] [e2e-cold]
#        [e2e-restart] [e2e-small] [e2e-quick]
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT:-out/h200_host}"
site="${SITE:-/tmp/site}"
mkdir -p "$out" "$site"
[ -e .host ] || { [ -d .host_gpu ] && ln -s .host_gpu .host; }
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
unset PYTHONDONTWRITEBYTECODE  # imports keep their bytecode, as on a user's machine
fa4="${FA4:-/tmp/fa4}"
host_copy=/root/comfyui-0.3.75
[ -z "${COMFYUI_PATH:-}" ] && [ -d "$host_copy" ] && export COMFYUI_PATH="$host_copy"
[ "${H3_FA4:-0}" = 1 ] && export PYTHONPATH="$fa4:$fa4/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH"
profile_servers() {  # py-spy on each ComfyUI server started until this is killed, one file per server
    [ -x /tmp/pyspy/bin/py-spy ] || python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy .whl_prof/*.whl \
        || return
    local seen=" " pid
    while sleep 0.05; do
        for pid in $(pgrep -f '^[^ ]*python[0-9.]* main[.]py '); do
            case "$seen" in *" $pid "*) continue ;; esac
            seen="$seen$pid "
            /tmp/pyspy/bin/py-spy record --pid "$pid" --threads --idle --rate 100 --nonblocking \
                --format speedscope -o "$out/server_$pid.speedscope.json" > "$out/pyspy_$pid.log" 2>&1 &
        done
    done
}
gpu_log() {  # the GPU's clocks, power, temperature, use and throttle reasons every 0.25 s into $1 until killed
    local fields=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu reasons
    for reasons in clocks_event_reasons.active clocks_throttle_reasons.active; do  # the newer name, then the older
        nvidia-smi --query-gpu="$fields,$reasons" --format=csv -i 0 > /dev/null 2>&1 || continue
        exec nvidia-smi --query-gpu="$fields,$reasons" --format=csv -lms 250 -i 0 > "$1"
    done
}
host_log() {  # the host's free and cached memory, huge pages and page-fault and compaction counters every 0.25 s
    echo "time,mem_free_kib,cached_kib,anon_huge_kib,thp_fault_alloc,thp_fault_fallback,pgfault,compact_stall" > "$1"
    while sleep 0.25; do
        awk -v t="$(date +%s.%N)" '
            FILENAME == "/proc/meminfo" { m[$1] = $2 } FILENAME == "/proc/vmstat" { v[$1] = $2 }
            END { print t "," m["MemFree:"] "," m["Cached:"] "," m["AnonHugePages:"] "," v["thp_fault_alloc"] "," \
                  v["thp_fault_fallback"] "," v["pgfault"] "," v["compact_stall"] }' /proc/meminfo /proc/vmstat >> "$1"
    done
}
on_gpu_server() {  # command... with ComfyUI's servers on the GPU, their frontend a page of its own (no browser here)
    mkdir -p /tmp/h3_frontend && echo "<html><body>H3 Hybrid on the GPU</body></html>" > /tmp/h3_frontend/index.html
    H3_COMFY_GPU=1 H3_COMFY_ARGS="--front-end-root /tmp/h3_frontend" "$@"
}
run() {  # name, command...
    local name="$1"; shift
    echo "== $name: $*"
    local start=$SECONDS
    "$@" > "$out/$name.log" 2>&1
    echo "   exit $? after $((SECONDS - start)) s ($(tail -1 "$out/$name.log" | cut -c1-200))"
}
for part in "$@"; do
    case "$part" in
        install)
            wheels=$(mktemp -d)
            for folder in .whl_a .whl_b .whl_c; do
                [ -d "$folder" ] && cp "$folder"/*.whl "$wheels"/ 2>/dev/null
            done
            if [ -f .whl_a/kitchen.part.aa ] && [ -f .whl_b/kitchen.part.ab ]; then
                cat .whl_a/kitchen.part.aa .whl_b/kitchen.part.ab \
                    > "$wheels/comfy_kitchen-0.2.40-cp312-abi3-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl"
            fi
            run install python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade \
                --target "$site" "$wheels"/*.whl
            # The carried host copied out of the checkout (a later call that does not carry it finds it there), and
            # bytecode for it and the pack, as a user's installation has after a first start
            if [ -d .host/comfyui-0.3.75 ]; then
                rm -rf "$host_copy" && cp -r .host/comfyui-0.3.75 "$host_copy"
                export COMFYUI_PATH="${COMFYUI_PATH:-$host_copy}"
            fi
            run compileall python3 -m compileall -q -j 0 $([ -d "$host_copy" ] && echo "$host_copy") h3_core nodes ;;
        fa4-a) mkdir -p /tmp/fa4_parts && cp .fa4_a/* /tmp/fa4_parts/ && echo "   FA4 part a kept" ;;
        fa4-b)
            cat /tmp/fa4_parts/cu13.part.aa .fa4_b/cu13.part.ab \
                > /tmp/fa4_parts/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
            rm -f /tmp/fa4_parts/cu13.part.aa
            run fa4_install python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade \
                --target "$fa4" /tmp/fa4_parts/*.whl ;;
        launches) run kernel_launches python3 bench/kernel_launches.py --out "$out/kernel_launches.json" ;;
        gpu) run gpu_tests python3 -m pytest -q -p no:warnings -rs tests/gpu tests/unit/test_text_encoder_file.py ;;
        checks) run gpu_checks python3 -m pytest -q -p no:warnings tests/gpu/test_hybrid_cuda.py \
                tests/gpu/test_offload_cuda.py tests/gpu/test_vae_cuda.py ;;
        quant) run quant_checks python3 -m pytest -q -p no:warnings -rs tests/gpu/test_quantized_cuda.py \
                tests/gpu/test_text_encoder_quantized_cuda.py tests/unit/test_text_encoder_file.py ;;
        lora) mkdir -p /root/h3_bench
            run lora_repatch python3 bench/lora_repatch.py --dit /root/h3_bench/minimax_h3_pruned_fp8_random.safetensors \
                --out "$out/lora_repatch.json" ;;
        load) models=/root/h3_e2e/models/diffusion_models
            run dit_load python3 bench/dit_load.py --dit $models/minimax_h3_fl2va_pruned_fp8_scaled_random.safetensors \
                --branch $models/vdn_h3_linear_branch_random.safetensors --out "$out/dit_load.json" ;;
        first-calls) run first_calls python3 bench/first_calls.py --processes 2 --with-warm-thread \
            --with-same-shapes-thread --out "$out/first_calls.json" ;;
        load-phases) models=/root/h3_e2e/models/diffusion_models
            run dit_load_phases python3 bench/dit_load.py --phases --reps 2 \
                --variants ${LOAD_VARIANTS:-8:8:64 16:8:64 8:32:64 16:32:64 16:16:128} \
                --dit $models/minimax_h3_fl2va_pruned_fp8_scaled_random.safetensors \
                --branch $models/vdn_h3_linear_branch_random.safetensors --out "$out/dit_load_phases.json" ;;
        mp4) run mp4_presets python3 bench/mp4_presets.py --photos .photos --threads 0 8 --out "$out/mp4_presets.json" ;;
        e2e-write) run e2e_write python3 bench/end_to_end.py --base /root/h3_e2e --phase write eval ;;
        e2e-files) run e2e_files python3 bench/end_to_end.py --base /root/h3_e2e --phase write ;;
        e2e-eval) run e2e_eval python3 bench/end_to_end.py --base /root/h3_e2e --phase eval ;;
        first-step|first-step-precompile)
            # The DiT's first evaluation in new processes sharing one compile cache (inductor, Triton, FA4's, as the
            # pack keeps them): empty, then filled (with
            # first-step-precompile, dynamo's own cache of traced frames too: TORCH_CACHING_PRECOMPILE=1)
            cache=/root/h3_first_step_cache; rm -rf "$cache"; label="${part#first-step}"
            for fill in empty filled; do
                TORCHINDUCTOR_CACHE_DIR="$cache/inductor" TRITON_CACHE_DIR="$cache/triton" \
                FLASH_ATTENTION_CUTE_DSL_CACHE_DIR="$cache/flash_attn_cute" FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 \
                TORCH_CACHING_PRECOMPILE=$([ -n "$label" ] && echo 1 || echo 0) \
                run "first_step${label}_$fill" python3 bench/dit_step.py --variants fp8-decomposed --fused-blocks \
                    compiled --reps 2 --first-profile 40 --out "$out/first_step${label}_$fill.json"
            done ;;
        desktop)
            on_gpu_server run desktop python3 bench/desktop.py \
                --base /root/h3_e2e --configs ${DESKTOP_CONFIGS:-none:0 24:64 16:32 12:32} --timeout 420 --warm-up
            cp /root/h3_e2e/desktop_state.json "$out/" ;;
        e2e-seed) mkdir -p /root/h3_e2e && cp .e2e_seed/end_to_end_state.json /root/h3_e2e/ && echo "   state seeded" ;;
        e2e-text) run e2e_text python3 bench/end_to_end.py --base /root/h3_e2e --phase text
            cp /root/h3_e2e/end_to_end_state.json "$out/" ;;
        e2e-quick) run e2e_quick_write python3 bench/end_to_end.py --base /root/h3_e2e --phase write ;&
        e2e-cold|e2e-restart|e2e-restart-t2va|e2e-restart-warm|e2e-small)
            phases=(cold); [ "$part" = e2e-restart ] && phases=(restart report)
            [ "$part" = e2e-restart-t2va ] && phases=(restart-t2va report)
            [ "$part" = e2e-restart-warm ] && phases=(restart-warm report)
            [ "$part" = e2e-quick ] && phases=(cold report)
            [ "$part" = e2e-small ] && phases=(small report)
            profiler=
            if [ "${E2E_PYSPY:-0}" = 1 ]; then profile_servers & profiler=$!; fi
            gpu_log "$out/gpu_${part}.csv" & clocks=$!
            host_log "$out/host_${part}.csv" & memory=$!
            gc_watch=()
            [ "${E2E_GC:-0}" = 1 ] && gc_watch=(env H3_GC_LOG="$(cd "$out" && pwd)/gc_${part}.jsonl" \
                PYTHONPATH="$PWD/bench/gc_watch:$PYTHONPATH")
            on_gpu_server run "${part/-/_}" "${gc_watch[@]}" python3 \
                bench/end_to_end.py --base /root/h3_e2e --phase "${phases[@]}" --repeat "${E2E_REPEAT:-1}" \
                $([ "${E2E_ADD:-0}" = 1 ] && echo --add-servers) \
                --out "$out/end_to_end.json"
            kill "$clocks" "$memory" 2> /dev/null
            if [ -n "$profiler" ]; then
                kill "$profiler"
                for _ in $(seq 150); do pgrep -f 'pyspy/bin/py-spy record' > /dev/null || break; sleep 0.2; done
                # one file for them all: a device call brings back only a few files
                (cd "$out" && tar czf "pyspy_${part}.tar.gz" server_*.speedscope.json pyspy_*.log \
                    && rm -f server_*.speedscope.json pyspy_*.log)
            fi
            cp /root/h3_e2e/end_to_end_state.json "$out/"
            cp /root/h3_e2e/server.log "$out/server_${part}.log" 2>/dev/null ;;  # the last server's whole log
        host)
            on_gpu_server run host_tests python3 -m pytest -q -p no:warnings -rs tests/host ;;
        gpu-and-host)
            oom=tests/host/test_host_interruptions.py::test_an_out_of_memory_mid_step_is_a_clear_error_and_the_server_goes_on
            run gpu_tests python3 -m pytest -q -p no:warnings -rs tests/gpu tests/unit/test_text_encoder_file.py &
            gpu_suite=$!
            on_gpu_server run host_tests python3 -m pytest -q -p no:warnings -rs tests/host --deselect "$oom"
            wait "$gpu_suite"
            on_gpu_server run host_out_of_memory python3 -m pytest -q -p no:warnings -rs "$oom" ;;
        devices)
            on_gpu_server run devices python3 -m pytest -q \
                -p no:warnings -rs "tests/host/test_host_model_management.py::test_each_loader_places_its_model_on_the_device_chosen_and_refuses_one_there_is_not" ;;
        multi-gpu)
            gpus=$(nvidia-smi -L | wc -l)
            split=$(( gpus >= 8 ? 6 : gpus - 1 ))
            run parallel_tests python3 -m pytest -q -p no:warnings -rs tests/gpu/test_parallel_cuda.py
            for layout in "1 0" "$gpus 0" "$gpus $split"; do
                read -r n softmax <<< "$layout"
                across=()
                [ "$n" -gt 1 ] && across=(--gpus "$n" --softmax-ranks "$softmax")
                run "multi_gpu_${n}_${softmax}" python3 bench/dit_step.py --variants fp8-decomposed --fused-blocks \
                    compiled --reps 3 "${across[@]}" --out "$out/multi_gpu_${n}_${softmax}.json"
            done
            on_gpu_server run multi_gpu_host python3 -m pytest -q \
                -p no:warnings -rs tests/host/test_host_multi_gpu.py ;;
        rank-shares)
            run rank_shares_1_0 python3 bench/dit_step.py --variants fp8-decomposed --fused-blocks compiled --reps 3 \
                --out "$out/rank_shares_1_0.json"
            for layout in "2 0:0 1" "4 0:0 3" "8 0:0 7" "8 6:0 5 6 7"; do
                world="${layout%% *}"; rest="${layout#* }"; split="${rest%%:*}"; which="${rest#*:}"
                run "rank_shares_${world}_${split}" python3 bench/dit_step.py --variants fp8-decomposed \
                    --fused-blocks compiled --reps 3 --fake-ranks "$world" --softmax-ranks "$split" \
                    --fake-rank $which --out "$out/rank_shares_${world}_${split}.json"
            done ;;
        fp8-attention)
            run cudnn_install python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade \
                --target "$site" .whl_cudnn/*.whl
            run fp8_attention_tests python3 -m pytest -q -p no:warnings -rs tests/gpu/test_fp8_attention_cuda.py
            run fp8_attention_calls python3 bench/fp8_attention.py --parts calls --kernels 10 \
                --out "$out/fp8_attention_calls.json"
            run dit_step_fp8_attention python3 bench/dit_step.py --variants fp8-decomposed --fused-blocks compiled \
                --branch-stream off on --attention-precision bf16 fp8 --reps 3 --out "$out/dit_step_fp8_attention.json" ;;
        fp8-attention-model)
            run fp8_attention_model python3 bench/fp8_attention.py --parts model --steps 8 \
                --out "$out/fp8_attention_model.json" ;;
        decode-stage)
            run decode_stage_native python3 bench/decode_stage.py --plan bench node heat80 bench node \
                --out "$out/decode_stage_native.json"
            PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync run decode_stage_async python3 bench/decode_stage.py \
                --plan bench node heat40 bench node --out "$out/decode_stage_async.json" ;;
        *) echo "unknown part $part"; exit 2 ;;
    esac
done
