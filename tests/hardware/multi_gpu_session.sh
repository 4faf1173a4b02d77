#!/usr/bin/env bash
# Issue 31's runs in one lent session on a machine with 2+ CUDA GPUs, written under $OUT.
#   checks: `gpulayer resources detect`, then tests/hardware (test_multi_gpu.py: DDP on one peer, a
#           devices=2 task, a 2-peer NCCL gang, two tasks on different GPUs; the 2-GPU DDP smoke test)
#   bench:  bench/trainer_ddp.py (glt against Lightning, DDP on 2 GPUs), bench/trainer_overhead.py on
#           one of them, and bench/gangs.py --nccl --mib 1024 (a 2-peer gang against torchrun)
# Run from the repository root on the device machine, with the wheels of .whl/ carried (zeroconf,
# ifaddr, cryptography, cffi, pycparser): tests/hardware/multi_gpu_session.sh checks
set -u
stage=${1:?checks or bench}
out=${OUT:?OUT is where the results go}
. tests/hardware/session_common.sh
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
[ "$gpus" -ge 2 ] || { echo "this machine has $gpus CUDA GPU(s); issue 31's runs need 2"; exit 3; }

if [ "$stage" = checks ]; then
    {
        echo "# tests/hardware on $gpus GPUs ($(date -u +%F)), $(python3 --version)," \
             "torch $(python3 -c 'import torch; print(torch.__version__)')"
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
        python3 -m gpulayer resources detect
        step hardware 400 python3 -m pytest -q -rs -p no:cacheprovider tests/hardware
    } > "$out/hardware_multi_gpu.txt" 2>&1
    tail -8 "$out/hardware_multi_gpu.txt"
elif [ "$stage" = bench ]; then
    step ddp 300 python3 bench/trainer_ddp.py --device cuda --devices 2 --json "$out/trainer_ddp_cuda.json"
    step gangs 150 python3 bench/gangs.py --nccl --mib 1024 --skip-start --skip-bandwidth \
        --json "$out/gangs_nccl.json" --plot "$out/gangs_nccl.png"
    step one_gpu 120 python3 bench/trainer_overhead.py --device cuda --models mlp --passes 2 --repeats 5 \
        --json "$out/trainer_overhead_cuda_1gpu.json"
else
    echo "unknown stage $stage" >&2; exit 2
fi
