# Sourced by the lent-GPU session scripts (h200_session.sh, multi_gpu_session.sh), from the repository root:
# installs the carried wheels of .whl/ into /tmp/site, sets the environment, and defines `step`.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

step() {  # step NAME SECONDS COMMAND...: run with a time limit, say how it ended
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout "$limit" "$@"
    echo "== $name: exit $? after $((SECONDS - t0)) s"
}
