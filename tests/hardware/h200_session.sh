#!/usr/bin/env bash
# One lent-GPU session's work, written under $OUT (at most 8 files come back).
#   checks: NVML readings idle and busy, tests/hardware, tests/torch with CUDA, Lightning parity on CUDA,
#           and a py-spy profile of a short MLP run of bench/trainer_overhead.py
#   bench:  the full bench/trainer_overhead.py on CUDA
# Run from the repository root on the device machine, with the wheels of .whl/ carried (zeroconf,
# ifaddr, cryptography, cffi, pycparser, py-spy): tests/hardware/h200_session.sh checks
set -u
stage=${1:?checks or bench}
out=${OUT:?OUT is where the results go}
. tests/hardware/session_common.sh

if [ "$stage" = checks ]; then
    step nvml 60 python3 tests/hardware/record_nvml.py --out "$out/nvml_h200_recorded.json"
    {
        echo "# tests/hardware on the lent NVIDIA H200 ($(date -u +%F)), $(python3 --version),"\
             "torch $(python3 -c 'import torch; print(torch.__version__)')"
        python3 -m gpulayer resources detect
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
        step hardware 120 python3 -m pytest -q -rs -p no:cacheprovider tests/hardware
    } > "$out/hardware_h200.txt" 2>&1
    tail -5 "$out/hardware_h200.txt"
    step torch 180 python3 -m pytest -q -rs -p no:cacheprovider tests/torch > "$out/torch_cuda.txt" 2>&1
    tail -5 "$out/torch_cuda.txt"
    step parity 100 python3 bench/lightning_parity.py --accelerator cuda --json "$out/lightning_parity_cuda.json"
    step profile 110 py-spy record --nonblocking -r 400 -f raw -o "$out/spy_mlp.txt" -- \
        python3 bench/trainer_overhead.py --device cuda --models mlp --steps 300 --passes 2 --repeats 8 \
        --json "$out/trainer_overhead_quick.json" --plot /tmp/quick.png
elif [ "$stage" = bench ]; then
    step bench 560 python3 bench/trainer_overhead.py --device cuda "${@:2}" \
        --json "$out/trainer_overhead_cuda.json"
else
    echo "unknown stage $stage" >&2; exit 2
fi
