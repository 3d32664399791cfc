#!/usr/bin/env bash
# Issue 31's 2-GPU runs, one after another, each stopping what it started (docs/benchmarks.md, "Two H100s"):
#   tp2    8B-class shape (dummy weights), tensor_parallel_size 2: plain `vllm ... --tensor-parallel-size 2` vs the
#          orchestrator, alternating, c=1/64/256; placement checks (status vs nvidia-smi) and nothing left after stop
#   tp2r   the TP=2 re-check at 256 streams alone (issue 31, item 1): 4 clients x 64 streams, 8 waves a pass (on
#          2026-11-28 one client at 256 streams saw TPOT ~2x the engines' own in both systems, and 2-wave passes of
#          ~5 s let the clients' start skew move throughput), 4 rounds, the order reversed every other round, the
#          engines' own TPOT, each client's cores and the all-clients-on window beside the client's numbers
#   dp2    the same shape at TP=1: plain vLLM on one GPU vs the orchestrator's 2 replicas (one GPU each), c=1 (the
#          TP=1 baseline of the TP=2/TP=1 ratio) and at saturation; each replica's share of the load
#   tests  tests/gpu (placement, env, replacement, stop)
#   pd2    PD over NIXL between the two GPUs (issue 32): benchmarks/pd.py, A = 2 colocated replicas (one GPU each) vs
#          B = 1 prefill (GPU 0) + 1 decode (GPU 1); prefill-heavy 4k in / 64 out and decode-heavy 128 in / 1k out;
#          the KV rate (GB/s) and the UCX transports the engines logged (needs NIXL: benchmarks/gpu/README.md)
# 4 GPUs (nvidia-h100-x4):
#   pd4    PD on 4 GPUs (issue 32, item 1): A = 4 colocated replicas (one GPU each) vs B = P prefill + D decode
#          replicas (PD4_LAYOUT="P D", default "2 2"; "3 1" for 3P1D), one GPU each; pd2's workloads, twice the
#          prompts and streams; PD4_SIZE (default 1b; 8b for the anchor's shape)
#   dp4    the 8B shape at TP=1: plain vLLM on one GPU vs the orchestrator's 4 replicas (one GPU each), c=1 and at
#          saturation; each replica's share of the load
#   vr4    the router at >= 1,024 streams against what a user would run instead: the orchestrator's 4 replicas vs
#          4 plain servers (one GPU each) behind vllm-router; router CPU per token of both
#   dpn4   the same 4 replicas vs one plain `vllm serve --data-parallel-size 4` (vLLM's own balancing)
#   tp4    a 32B shape (dummy weights), tensor_parallel_size 4: plain vs the orchestrator at c=1 and 64, ranks on
#          four distinct GPUs (placement check)
#   tune4  action=auto_tune over instance x tensor_parallel_size (1, 2, 4 each; more than 4 GPUs pruned) on the 8B
#          shape, whole GPUs, TTFT/TPOT SLO: goodput per GPU ranks them, run_best leaves the winner serving (checked:
#          status and a completion), against the node as written (1 replica, TP=1) (benchmarks/auto_tune.py)
#   tune2  the same on 2 GPUs (instance x TP over 1, 2); TUNE_PER_DEVICE=1: each level and the prompts x the
#          candidate's GPUs (auto_tuner.concurrency_per_device), so layouts over different GPU counts compare fairly
#   dpi2   vLLM's own data_parallel_size 2 inside one replica: plain `--data-parallel-size 2` vs the orchestrator
#   ep2    expert parallel (issue 55): a random-weight MoE shape (model.py moe-3b, Mixtral form, 16 experts, dummy
#          weights), data_parallel_size 2 + enable_expert_parallel on 2 GPUs through the orchestrator vs plain
#          `vllm serve --data-parallel-size 2 --enable-expert-parallel` (the same flags) vs 2 independent TP=1
#          replicas (one GPU each, no EP), alternating, c=1/64/256, 4 clients; placement check (each DP rank on its
#          own GPU as status says), the env check, nothing left after stop. Target: orchestrator >= 0.98x plain.
#          Plain is `vllm serve` itself (one API server per DP rank, its CLI default); EP_PLAIN_ENTRY=api_server
#          compares with one API server, as the orchestrator's replica runs
#   ep4    the same with DP=4 on 4 GPUs against 4 TP=1 replicas
#   eptest tests/gpu/test_expert_parallel.py: placement and env of every rank, DP/EP index in status, a rank killed ->
#          the replica replaced, stop (DP=4 too where there are 4 GPUs)
# 1 GPU (issue 36):
#   llama1 the CUDA llama-server (built first if missing: the llama-cpp-python sdist under $LLAMA_CPP_SDIST_DIR,
#          nothing downloaded), a random-weight 1B Llama as f16 GGUF: plain llama-server vs the orchestrator on GPU 0,
#          then vLLM (plain vs the orchestrator) on the same shape and load; the GPU test of llama.cpp. Its parts
#          are steps too: llamaprep (CPU only: the build, the model, its GGUF; may run beside another chain),
#          llamabench, vllm1, llamatest (LLAMA1_ROUNDS, LLAMA1_PROMPTS shorten the benchmarks)
#   dptest the GPU test of vLLM's data_parallel_size 2 inside one replica alone
#   pdtest tests/gpu/test_pd.py's 1P1D checks alone (2 GPUs, NIXL installed): KV over cuda_ipc, multicast off, stop
#   pdfs4  FlagScale's own xpyd PD config (2 prefill + 2 decode, a GPU each) as it is, model path overridden to a
#          random-weight Qwen2.5-7B shape (tests/gpu/test_pd.py; NIXL carried; the configs carried as
#          .gpu-wheels/flagscale-configs, a copy of ../shared/flagscale-configs, or FLAGSCALE_CONFIGS)
#   pdfs2  the same on 2 GPUs: as it is, refused before any start; with prefill_num=1 decode_num=1, 1P1D served
#   itl1   the 1-GPU check at 1,024 streams (issue 31, item 3): 4 clients x 256 streams, 256 in / 256 out, plain vLLM
#          vs the orchestrator on GPU ITL1_GPU (1), pinned to cores ITL1_CPUS (0-15)
# SGLang (issue 32; after benchmarks/gpu/sglang_pack.sh's install into /tmp/sgl-site, FLAGSCALE_SGLANG_PATH):
#   sgl1   plain `python -m sglang.launch_server` vs the orchestrator's `engine: sglang` replica on a 1B shape, c=1/16/64
#          (tests/gpu/test_sglang.py first: TP=1, and TP=2 where there are 2 GPUs)
# The fleet issues (51, 52, 53), 2026-11-29:
#   lora2  issue 52: benchmarks/lora_bench.py --gpu: 50 generated rank-8 adapters of the 1B shape, Zipf and a hot
#          adapter, 2 engines (one per visible GPU; LORA2_ARGS=--same-gpu: both on the first), max_loras 16,
#          every adapter host-held: the adapter placement vs the same router adapter-oblivious vs one plain engine
#   slo2   issue 51: benchmarks/slo_load.py --gpu: the SLO planner, with vLLM sleep (slo_sleep: max started, the
#          unwanted asleep) and without, vs request-count autoscaling vs static max (1..2 replicas, one GPU each) on
#          the seeded bursty trace (x0.4), one replica's rate calibrated first (or SLO2_ARGS="--rate R --target T");
#          SLO2_ARGS="--time-scale 2 --gpus-per-replica 0.5 --max-replicas 4": 1..4 replicas, two a GPU; with
#          sleep the x0.4 trace suffices: "--gpus-per-replica 0.5 --max-replicas 4 --systems static_max slo_sleep";
#          one GPU: "--size 8b --dummy-weights --gpus-per-replica 0.25 --max-replicas 4 --time-scale 1
#          --kv-cache-gib 14" (the KV cache sized: the 4 replicas start together, not in turn; a 1B
#          replica at a quarter of an H200 sustains more than 32 benchmark workers send: slo_load refuses it)
#   kv4    issue 53: benchmarks/kv_routing.py --gpu: 4 engines of the 8B shape (dummy weights) on one GPU, capped
#          KV caches; cache_aware on KV events vs the approximate table vs round_robin vs vllm-router, workloads
#          (a) shared prefixes, (c) no reuse, (d) router restarted, (e) 2 router processes; the oracle's hit rate
#   awake  issue 51 item 3: benchmarks/gpu/sleep_share.py --systems awake: the three 1B models always awake on one
#          GPU (the sleep system ran on 2026-11-29), the same trace
# On the GPU machine after ../shared/gpu/README.md's install, from the repo root, in a session of its own:
#   setsid nohup bash benchmarks/gpu/multi_gpu.sh /tmp/bench tp2 dp2 tests > /tmp/bench/chain.log 2>&1 < /dev/null &
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # NVLink multicast off, always
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
out=${1:-/tmp/bench}
shift || true
mkdir -p "$out"
out=$(cd "$out" && pwd)
steps=${*:-tp2 dp2 tests}
# Every call of the device tool copies the working tree afresh, so a file can be missing for a moment under a chain
# that runs from it (on 2026-11-28 a poll made tp2r's `run.py status` fail on a missing module). The chain runs from
# a snapshot of the repo taken now (with the carried FlagScale configs); FLAGSCALE_CHAIN_SNAPSHOT=0 runs in place.
if [ "${FLAGSCALE_CHAIN_SNAPSHOT:-1}" = 1 ]; then
  snap=$(mktemp -d "${TMPDIR:-/tmp}/flagscale-chain-XXXXXX")
  tar -C "$PWD" --exclude=./.git --exclude=./.venv --exclude=./.gpu-wheels -cf - . | tar -C "$snap" -xf - || exit 1
  [ -d .gpu-wheels/flagscale-configs ] && { mkdir -p "$snap/.gpu-wheels" && cp -r .gpu-wheels/flagscale-configs "$snap/.gpu-wheels/"; }
  echo "=== running from a snapshot of the repo: $snap"
  cd "$snap" && FLAGSCALE_CHAIN_SNAPSHOT=0 exec bash benchmarks/gpu/multi_gpu.sh "$out" $steps
fi
model="--size 8b --dummy-weights --input-len 512 --output-len 128 --clients 1 --waves 2 --keep-plain --placement-check"
# Stopped early: `kill -TERM -- -<the chain's process group>` (a chain started in the background ignores SIGINT).
# The running step stops what it started (bench_gpu.py, auto_tune.py and run.py handle SIGTERM), and no later step
# begins.
trap 'interrupted=1' TERM
# llama1's parts, each a step of its own: `llamaprep` uses CPUs only (the CUDA build, the 1B model written on the
# CPU, its GGUF), so it can run beside a GPU step, confined to LLAMA_PREP_CPUS (default: the upper quarter) at
# nice 19; the steps after it find its results cached.
gguf=""
llama_prep() {
  local m conv cpus
  cpus=${LLAMA_PREP_CPUS:-$(( $(nproc) * 3 / 4 ))-$(( $(nproc) - 1 ))}
  FLAGSCALE_LLAMA_CPP_SDIST=${LLAMA_CPP_SDIST_DIR:-/tmp/lc}/llama_cpp_python-0.3.36.tar.gz \
    taskset -c "$cpus" nice -n 19 python3 -m flagscale.engines.llama_cpp_build || return
  m=$(taskset -c "$cpus" nice -n 19 python3 benchmarks/gpu/model.py --size 1b --device cpu) || return
  conv=$(python3 -c "from flagscale.engines import llama_cpp_build as b; print(b.converter_dir())") || return
  gguf=$m-gguf/model-f16.gguf
  [ -f "$gguf" ] || { mkdir -p "$m-gguf" && taskset -c "$cpus" nice -n 19 \
    python3 -m flagscale.demo_model to-gguf "$conv" "$m" "$gguf" f16; } || return
  echo "llama1 prepared: $gguf"
}
llama_bench() {
  llama_prep || return
  python3 benchmarks/llama_cpp.py --gpu --gguf "$gguf" --tokenizer "${gguf%-gguf/*}" --parallel 64 \
    --max-model-len 1024 --threads 4 --rounds "${LLAMA1_ROUNDS:-2}" --num-prompts "${LLAMA1_PROMPTS:-128}" \
    --concurrency 1 16 64 --input-len 512 --output-len 128 --output "$out/llama1.json"
}
vllm1() {
  python3 benchmarks/gpu/bench_gpu.py --size 1b --input-len 512 --output-len 128 --clients 1 --waves 2 \
    --keep-plain --rounds "${LLAMA1_ROUNDS:-2}" --concurrency 1 16 64 --output "$out/vllm1.json"
}
llama_test() {
  llama_prep || return
  python3 -m pytest tests/gpu/test_llama_cpp.py -v -p no:cacheprovider --junitxml="$out/tests-llama.xml"
}
# A step's engines can hold GPU memory for a while after the step stopped them (on 2026-11-30 lora2's engine found
# 24 GB held on GPU 0 ~80 s after a kv4 of 4 engines there had ended, presumably one still exiting, and refused to
# start; the same command a minute later started): each step first waits, bounded, for its visible GPUs
# (CUDA_VISIBLE_DEVICES, else all) to hold no process.
gpus_free() {
  local waited=0 held
  while held=$(nvidia-smi ${CUDA_VISIBLE_DEVICES:+-i "$CUDA_VISIBLE_DEVICES"} --query-compute-apps=pid,used_memory \
      --format=csv,noheader 2>/dev/null) && [ -n "$held" ]; do
    if [ $waited -ge ${GPU_FREE_WAIT_S:-180} ]; then
      echo "=== GPUs still hold processes after ${waited} s, starting anyway:" $held; return
    fi
    [ $((waited % 30)) -eq 0 ] && echo "=== waiting for the GPUs to free (${waited} s):" $held
    sleep 5; waited=$((waited + 5))
  done
}
for step in $steps; do
  [ -n "${interrupted:-}" ] && { echo "=== interrupted before $step"; break; }
  gpus_free
  echo "=== $step start $(date -u +%T)"
  case $step in
    tp2) python3 benchmarks/gpu/bench_gpu.py $model --engine-arg tensor_parallel_size=2 --rounds 3 \
           --concurrency 1 64 256 --output "$out/tp2.json" ;;
    tp2r) python3 benchmarks/gpu/bench_gpu.py $model --engine-arg tensor_parallel_size=2 --rounds 4 \
           --clients 4 --waves 8 --concurrency 64 --output "$out/tp2r.json" ;;
    dp2) python3 benchmarks/gpu/bench_gpu.py $model --replicas 2 --gpus-per-replica 1 --no-orchestrator \
           --gpu-memory-utilization 0.43 --replica-gpu-memory-utilization 0.43 --rounds 2 \
           --concurrency 1 256 512 --output "$out/dp2.json" ;;
    dp4) python3 benchmarks/gpu/bench_gpu.py $model --replicas 4 --gpus-per-replica 1 --no-orchestrator \
           --gpu-memory-utilization 0.43 --replica-gpu-memory-utilization 0.43 --rounds 2 \
           --concurrency 1 512 1024 --output "$out/dp4.json" ;;
    vr4|dpn4) plain=$([ "$step" = vr4 ] && echo vllm-router || echo dp)
         python3 benchmarks/gpu/bench_gpu.py $model --replicas 4 --gpus-per-replica 1 --no-orchestrator \
           --plain "$plain" --gpu-memory-utilization 0.43 --replica-gpu-memory-utilization 0.43 --rounds 2 \
           --concurrency 1024 2048 --output "$out/$step.json" ;;
    tp4) python3 benchmarks/gpu/bench_gpu.py ${model/--size 8b/--size 32b} --engine-arg tensor_parallel_size=4 \
           --gpu-memory-utilization 0.43 --rounds 1 --concurrency 1 64 --output "$out/tp4.json" ;;
    tune2|tune4) n=${step#tune}; sizes=$([ "$n" = 4 ] && echo "1, 2, 4" || echo "1, 2")
         python3 benchmarks/auto_tune.py --gpu --size 8b --dummy-weights --gpus-per-replica 1 \
           --gpu-memory-utilization 0.85 --space "{\"instance\": [$sizes], \"tensor_parallel_size\": [$sizes]}" \
           --input-len 512 --output-len 128 --prompts 256 --levels 64 256 --ttft-p99 2000 --tpot-p99 40 --skip-default \
           --run-best ${TUNE_PER_DEVICE:+--per-device} --output "$out/$step.json" ;;
    dpi2) python3 benchmarks/gpu/bench_gpu.py $model --engine-arg data_parallel_size=2 --rounds 2 \
           --concurrency 1 256 512 --output "$out/dpi2.json" ;;
    ep2|ep4) n=${step#ep}
         python3 benchmarks/gpu/bench_gpu.py ${model/--size 8b/--size moe-3b} --clients 4 \
           --engine-arg data_parallel_size=$n --engine-arg enable_expert_parallel=true \
           --replicas $n --gpus-per-replica 1 --replica-engine-arg data_parallel_size=1 \
           --replica-engine-arg enable_expert_parallel=false --rounds 3 --concurrency 1 64 256 \
           --plain-entry "${EP_PLAIN_ENTRY:-serve}" --output "$out/$step.json" ;;
    eptest) python3 -m pytest tests/gpu/test_expert_parallel.py -v -p no:cacheprovider \
              --junitxml="$out/tests-ep.xml" ;;
    pd2) python3 benchmarks/pd.py --size 1b --num-gpus 1 --gpu-memory-utilization 0.4 --max-num-seqs 256 \
           --max-model-len 8192 --systems A B --rounds 2 --concurrency 16 --prefill-prompts 64 \
           --prefill-input-len 4096 --prefill-output-len 64 --decode-prompts 48 --decode-input-len 128 \
           --decode-output-len 1024 --slo-ttft-ms 1000 --slo-tpot-ms 20 --output "$out/pd2.json" ;;
    pd4) read -r p d <<< "${PD4_LAYOUT:-2 2}"
         python3 benchmarks/pd.py --size "${PD4_SIZE:-1b}" --num-gpus 1 --prefill-replicas "$p" --decode-replicas "$d" \
           --gpu-memory-utilization 0.4 --max-num-seqs 256 --max-model-len 8192 --systems A B --rounds 2 \
           --concurrency 32 --prefill-prompts 128 --prefill-input-len 4096 --prefill-output-len 64 \
           --decode-prompts 96 --decode-input-len 128 --decode-output-len 1024 --slo-ttft-ms 1000 --slo-tpot-ms 20 \
           --output "$out/pd4-${p}p${d}d.json" ;;
    tests) python3 -m pytest tests/gpu -v -p no:cacheprovider --junitxml="$out/tests-gpu.xml" ;;
    llama1) llama_bench; vllm1; llama_test ;;
    llamaprep) llama_prep ;;
    llamabench) llama_bench ;;
    vllm1) vllm1 ;;
    llamatest) llama_test ;;
    sgl1) export FLAGSCALE_SGLANG_PATH=${FLAGSCALE_SGLANG_PATH:-/tmp/sgl-site}
          python3 -m pytest tests/gpu/test_sglang.py -v -p no:cacheprovider --junitxml="$out/tests-sglang.xml"
          python3 benchmarks/gpu/bench_gpu.py --engine sglang --size 1b --input-len 512 --output-len 128 --clients 1 \
            --waves 2 --keep-plain --rounds 2 --concurrency 1 16 64 --output "$out/sgl1.json" ;;
    pdfs2|pdfs4) configs=${FLAGSCALE_CONFIGS:-$PWD/.gpu-wheels/flagscale-configs}
           # the test skips without the configs; asked for by name, their absence is this step's failure
           if [ ! -d "$configs/qwen2_5-disagg-xpyd" ]; then
             echo "$step: no FlagScale configs at $configs (carry .gpu-wheels/flagscale-configs in the call that" \
               "starts the chain, or copy them out of the repo and give FLAGSCALE_CONFIGS)"; false
           else
             FLAGSCALE_CONFIGS=$configs python3 -m pytest tests/gpu/test_pd.py -v -p no:cacheprovider \
               -k flagscale_xpyd --junitxml="$out/tests-$step.xml"
           fi ;;
    itl1) CUDA_VISIBLE_DEVICES=${ITL1_GPU:-1} taskset -c "${ITL1_CPUS:-0-15}" python3 benchmarks/gpu/bench_gpu.py \
            --size 1b --rounds 2 --clients 4 --concurrency 256 --input-len 256 --output-len 256 --keep-plain \
            --output "$out/itl1.json" ;;
    pdtest) python3 -m pytest tests/gpu/test_pd.py -v -p no:cacheprovider -k "not flagscale_xpyd" \
              --junitxml="$out/tests-pd.xml" ;;
    dptest) python3 -m pytest tests/gpu/test_placement.py -v -p no:cacheprovider -k dp2_inside \
              --junitxml="$out/tests-dp.xml" ;;
    kv4) python3 benchmarks/kv_routing.py --gpu --pass-s 12 ${KV4_ARGS:-} --output "$out/kv4.json" ;;
    lora2) python3 benchmarks/lora_bench.py --gpu ${LORA2_ARGS:-} --output "$out/lora2.json" ;;
    slo2) python3 benchmarks/slo_load.py --gpu --size 1b ${SLO2_ARGS:-} --out "$out/slo2.json" ;;
    awake) (repo=$PWD; cd benchmarks/gpu && PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" python3 sleep_share.py \
             --size 1b --systems awake --phase-s 15 --out "$out/awake") ;;
    *) echo "unknown step $step" ;;
  esac
  echo "=== $step exit $? $(date -u +%T)"
  nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv,noheader
done
echo "=== chain done $(date -u +%T)"
