"""Unit tests of gpulayer.matching: Requirements validation, match() reasons and rank_key ordering.

The rules under test are ADR-0006 (DESIGN.md, "Matching rules"): accelerator isolation with no
fallback in either direction, gpu_memory_gb against dedicated or unified memory, PEP 440 framework
specifiers, capabilities implied by a framework on an accelerator, and no multi-device runs on MPS.
"""

from __future__ import annotations

import dataclasses
import msgpack
import pytest
from hypothesis import event, example, given, settings
from hypothesis import strategies as st
from support import built_or_refused

from gpulayer.matching import Requirements, match, needed_capabilities, rank_key
from gpulayer.resources.model import PROTOCOL_VERSION, Advert, Device, Framework, Resources


# ---- advert builders ------------------------------------------------------------------------------

def make_advert(accelerator: str = "cpu", *, memory=(), frameworks=(), distributed: str | None = None,
                slots: int = 1, name: str = "box", peer_id: str | None = None, version: int = PROTOCOL_VERSION,
                ram_gb: float = 64.0, python: str = "3.11.7", distributions: dict | None = None) -> Advert:
    """An Advert built the way a peer builds it: Resources -> Advert.from_resources.

    `memory` is one entry per GPU (GB); on "mps" it is the unified memory size of the Mac.
    `frameworks` is a sequence of (name, version, capabilities). `distributions` makes it the
    peer's own advert, which knows every installed distribution.
    """
    devices = []
    if accelerator == "cuda":
        devices = [Device(i, "cuda", "NVIDIA H200", m, "dedicated", "hardware-validated", distributed or "nccl")
                   for i, m in enumerate(memory or (80.0,))]
    elif accelerator == "mps":
        devices = [Device(0, "mps", "Apple M3 Max", (memory or (ram_gb,))[0], "unified", "hardware-validated",
                          distributed or "unsupported")]
    res = Resources(
        host=name, system="Darwin" if accelerator == "mps" else "Linux",
        machine="arm64" if accelerator == "mps" else "x86_64", cpu_name="Test CPU", cpu_count=16,
        memory_gb=ram_gb, python=python, devices=devices,
        frameworks=[Framework(n, v, tuple(caps)) for n, v, caps in frameworks], distributions=distributions,
    )
    advert = Advert.from_resources(res, peer_id=peer_id or f"id-{name}", name=name, cluster="c0ffee", slots=slots)
    if version != PROTOCOL_VERSION:
        advert = dataclasses.replace(advert, version=version)
    return advert


TORCH_CUDA = ("torch", "2.13.0+cu128", ("torch.cuda",))
TORCH_MPS = ("torch", "2.13.0", ("torch.mps",))
TORCH_CPU = ("torch", "2.13.0+cpu", ())
MLX_METAL = ("mlx", "0.32.4", ("mlx.metal",))
MLX_CPU = ("mlx", "0.32.4", ("mlx.cpu",))

CPU_PEER = make_advert("cpu", name="cpu-box")
CUDA_PEER = make_advert("cuda", memory=(80.0,), name="cuda-box")
MAC_PEER = make_advert("mps", memory=(36.0,), name="mac-box")
PEERS = {"cpu": CPU_PEER, "cuda": CUDA_PEER, "mps": MAC_PEER}


def req(**kwargs) -> Requirements:
    return Requirements.build(**kwargs)


def reasons_text(reasons) -> str:
    return "; ".join(reasons)


# ---- Requirements.build validation ------------------------------------------------------------------

@pytest.mark.parametrize("accelerator", ["tpu", "CUDA", "", "metal", 1, ["cuda"]])
def test_build_rejects_unknown_accelerator(accelerator):
    with pytest.raises(ValueError, match="accelerator"):
        Requirements.build(accelerator=accelerator)


@pytest.mark.parametrize("accelerator", [None, "cpu", "cuda", "mps", "gpu"])
def test_build_accepts_known_accelerators(accelerator):
    assert Requirements.build(accelerator=accelerator).accelerator == accelerator


@pytest.mark.parametrize("mem", [-1, -0.5, True, False, "8", [8], float("-inf")])
def test_build_rejects_bad_gpu_memory(mem):
    with pytest.raises(ValueError, match="gpu_memory_gb"):
        Requirements.build(gpu_memory_gb=mem)


def test_build_rejects_gpu_memory_with_cpu_accelerator():
    with pytest.raises(ValueError, match="accelerator='cpu'"):
        Requirements.build(accelerator="cpu", gpu_memory_gb=4)


def test_gpu_memory_implies_a_gpu_and_is_a_float():
    r = Requirements.build(gpu_memory_gb=8)
    assert r.accelerator == "gpu"
    assert r.gpu_memory_gb == 8.0 and isinstance(r.gpu_memory_gb, float)
    assert Requirements.build(accelerator="cuda", gpu_memory_gb=0).accelerator == "cuda"
    assert Requirements.build(accelerator="mps", gpu_memory_gb=16.5).gpu_memory_gb == 16.5


def test_build_rejects_nan_gpu_memory():
    with pytest.raises(ValueError, match="gpu_memory_gb"):
        Requirements.build(gpu_memory_gb=float("nan"))


@pytest.mark.parametrize("spec", ["2.4", "=>2.4", ">=abc", "~=2", ">=2.4.*", "torch>=2", "== 2.4 2.5"])
def test_build_rejects_bad_pep440_specifiers(spec):
    with pytest.raises(ValueError, match="PEP 440"):
        Requirements.build(frameworks={"torch": spec})


@pytest.mark.parametrize("frameworks", [{"torch": 2.4}, {"torch": None}, {1: ">=1"}, {"torch": b">=2"}])
def test_build_rejects_non_string_framework_entries(frameworks):
    with pytest.raises(ValueError, match="frameworks"):
        Requirements.build(frameworks=frameworks)


@pytest.mark.parametrize("spec", ["", ">=2.4", ">= 2.4", "==2.13.*", ">=2,<3", "~=2.4", "!=2.5.0"])
def test_build_accepts_valid_specifiers(spec):
    assert Requirements.build(frameworks={"torch": spec}).frameworks == (("torch", spec),)


@pytest.mark.parametrize("devices", [0, -1, True, False, 1.5, 2.0, "2", None])
def test_build_rejects_bad_devices(devices):
    with pytest.raises(ValueError, match="devices"):
        Requirements.build(devices=devices)


@pytest.mark.parametrize("frameworks", [["torch", "numpy"], ("numpy", "torch"), {"torch", "numpy"},
                                        frozenset({"numpy", "torch"})])
def test_frameworks_as_a_collection_mean_any_version(frameworks):
    r = Requirements.build(frameworks=frameworks)
    assert r.frameworks == (("numpy", ""), ("torch", ""))


def test_frameworks_are_sorted_and_capabilities_normalised():
    r = Requirements.build(frameworks={"torch": ">=2", "mlx": ""}, capabilities="torch.cuda")
    assert r.frameworks == (("mlx", ""), ("torch", ">=2"))
    assert r.capabilities == frozenset({"torch.cuda"})
    assert Requirements.build(capabilities=["a", "b", "a"]).capabilities == frozenset({"a", "b"})


@pytest.mark.parametrize("peer", [1, b"box", ["box"]])
def test_build_rejects_non_string_peer(peer):
    with pytest.raises(ValueError, match="peer"):
        Requirements.build(peer=peer)


def test_requirements_are_hashable_and_equal_when_built_alike():
    a = Requirements.build(accelerator="cuda", gpu_memory_gb=8, frameworks={"torch": ">=2"})
    b = Requirements.build(accelerator="cuda", gpu_memory_gb=8.0, frameworks={"torch": ">=2"})
    assert a == b and hash(a) == hash(b)


# ---- to_wire / from_wire ------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [
    {},
    {"accelerator": "cpu"},
    {"accelerator": "cuda", "gpu_memory_gb": 40, "devices": 2},
    {"accelerator": "mps", "frameworks": {"torch": ">=2.4", "mlx": ""}, "capabilities": {"x.y", "a.b"}},
    {"gpu_memory_gb": 0.5, "frameworks": ["numpy"]},
    {"python": ">=3.11,<3.12", "code_python": "3.11", "uses": ("torch", "mlx")},
])
def test_wire_round_trip(kwargs):
    r = Requirements.build(**kwargs)
    wire_form = msgpack.unpackb(msgpack.packb(r.to_wire()), raw=False)  # as it travels
    assert Requirements.from_wire(wire_form) == r


def test_wire_form_does_not_carry_the_peer_filter():
    r = Requirements.build(accelerator="cuda", peer="box")
    back = Requirements.from_wire(r.to_wire())
    assert back.peer is None
    assert back == dataclasses.replace(r, peer=None)


def test_from_wire_of_an_empty_map_is_the_default():
    assert Requirements.from_wire({}) == Requirements.build()


@pytest.mark.parametrize("data", [
    None, [], "acc=cuda", 1, b"\x80",
    {"fw": "torch"}, {"fw": {"torch": ">=2"}}, {"fw": ["torch>=2"]}, {"fw": [["torch"]]},
    {"fw": [["torch", ">=2", "x"]]}, {"fw": [("torch", ">=2")]}, {"fw": [["torch", 2]]}, {"fw": [[1, ">=2"]]},
    {"fw": [["torch", "nope"]]},
    {"cap": "torch.cuda"}, {"cap": [1]}, {"cap": {"torch.cuda": 1}},
    {"acc": "tpu"}, {"acc": 3},
    {"mem": "8"}, {"mem": -1}, {"mem": True}, {"acc": "cpu", "mem": 4},
    {"dev": 0}, {"dev": "2"}, {"dev": True}, {"dev": None}, {"dev": 1.0},
    {"py": 3.11}, {"py": "3.11"}, {"py": [">=3"]}, {"pc": 3.11}, {"pc": "3"}, {"pc": ">=3.11"}, {"pc": "3.11.7"},
    {"use": "torch"}, {"use": [1]}, {"use": {"torch": 1}},
])
def test_from_wire_rejects_malformed_maps(data):
    with pytest.raises(ValueError):
        Requirements.from_wire(data)


@pytest.mark.parametrize("data", [{"fw": [[["torch"], ">=2"]]}, {"fw": [[{"torch": 1}, ">=2"]]}])
def test_from_wire_rejects_unhashable_framework_names_with_value_error(data):
    with pytest.raises(ValueError):
        Requirements.from_wire(data)


_WIRE_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
                            | st.sampled_from(["3.11", ">=3.11", "torch", ""]),
                            lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                        max_size=3), max_leaves=6)


@settings(max_examples=300, deadline=None)
@given(data=st.dictionaries(st.sampled_from(["py", "pc", "use"]), _WIRE_VALUES, max_size=3))
@example({"py": ">=3.11", "pc": "3.11", "use": ["torch"]})  # built: each field survives its wire form
def test_the_python_and_uses_fields_from_the_wire_are_built_or_refused_with_value_error(data):
    event(built_or_refused(data))


# ---- match(): accelerator isolation -------------------------------------------------------------------

@pytest.mark.parametrize("task, peer, ok", [
    ("cuda", "cuda", True), ("cuda", "mps", False), ("cuda", "cpu", False),
    ("mps", "mps", True), ("mps", "cuda", False), ("mps", "cpu", False),
    ("gpu", "cuda", True), ("gpu", "mps", True), ("gpu", "cpu", False),
    ("cpu", "cpu", True), ("cpu", "cuda", True), ("cpu", "mps", True),
    (None, "cpu", True), (None, "cuda", True), (None, "mps", True),
])
def test_accelerator_isolation(task, peer, ok):
    reasons = match(req(accelerator=task), PEERS[peer])
    assert (reasons == ()) is ok, reasons
    if not ok:
        assert len(reasons) == 1
        assert f"peer offers {peer}" in reasons[0]
        assert ("cuda or mps" if task == "gpu" else f"needs {task}") in reasons[0]


def test_cuda_never_falls_back_to_mps_even_with_everything_else_fitting():
    mac = make_advert("mps", memory=(192.0,), frameworks=[("torch", "2.13.0", ("torch.mps", "torch.cuda"))])
    assert match(req(accelerator="cuda", frameworks={"torch": ">=2"}), mac)
    cuda = make_advert("cuda", memory=(80.0,), frameworks=[("torch", "2.13.0", ("torch.cuda", "torch.mps"))])
    assert match(req(accelerator="mps", frameworks={"torch": ">=2"}), cuda)


def test_match_is_empty_tuple_when_everything_fits():
    advert = make_advert("cuda", memory=(80.0, 80.0), frameworks=[TORCH_CUDA], slots=2)
    r = req(accelerator="cuda", gpu_memory_gb=40, frameworks={"torch": ">=2.4"}, devices=2, peer="box")
    assert match(r, advert) == ()


# ---- match(): GPU memory ---------------------------------------------------------------------------

@pytest.mark.parametrize("need, ok", [(0, True), (24, True), (80, True), (80.05, False), (81, False), (1000, False)])
def test_gpu_memory_against_dedicated_memory(need, ok):
    advert = make_advert("cuda", memory=(24.0, 80.0))  # the biggest device counts
    reasons = match(req(accelerator="cuda", gpu_memory_gb=need), advert)
    assert (reasons == ()) is ok, reasons
    if not ok:
        assert reasons == (f"needs {need:g} GB of GPU memory; peer has 80 GB dedicated",)


@pytest.mark.parametrize("accelerator", ["gpu", "mps"])
@pytest.mark.parametrize("need, ok", [(16, True), (36, True), (48, False)])
def test_gpu_memory_against_unified_memory_on_a_mac(accelerator, need, ok):
    reasons = match(req(accelerator=accelerator, gpu_memory_gb=need), MAC_PEER)
    assert (reasons == ()) is ok, reasons
    if not ok:
        assert "peer has 36 GB unified" in reasons_text(reasons)


def test_gpu_memory_on_a_cpu_peer_is_refused_for_lack_of_a_gpu():
    reasons = match(req(gpu_memory_gb=1), CPU_PEER)
    assert len(reasons) == 1 and "needs a GPU" in reasons[0]


# ---- match(): frameworks and PEP 440 -------------------------------------------------------------

@pytest.mark.parametrize("installed, spec, ok", [
    ("2.13.0+cpu", ">=2.4", True),
    ("2.13.0+cpu", "==2.13.0", True),          # a local label is ignored by a spec without one
    ("2.13.0+cpu", "==2.13.*", True),
    ("2.13.0+cpu", "==2.13.0+cpu", True),
    ("2.13.0+cpu", "==2.13.0+cu121", False),
    ("2.13.0+cpu", "<2.13", False),
    ("2.13.0+cpu", ">=2.4,<3", True),
    ("2.13.0+cpu", "~=2.12", True),
    ("2.13.0+cpu", "!=2.13.0", False),
    ("2.5.0rc1", ">=2.4", True),               # prereleases are accepted
    ("2.5.0.dev0", ">=2.4", True),
    ("2.4.0rc1", ">=2.4", False),              # ... but a prerelease of 2.4 is older than 2.4
    ("2.5.0rc1", "<2.5", False),
    ("2.3.1", ">=2.4", False),
    ("not-a-version", ">=1", False),
    ("whatever", "", True),                    # any version
])
def test_framework_versions_are_pep440(installed, spec, ok):
    advert = make_advert("cpu", frameworks=[("torch", installed, ())])
    reasons = match(req(frameworks={"torch": spec}), advert)
    assert (reasons == ()) is ok, reasons
    if not ok:
        assert reasons == (f"torch {installed} does not satisfy {spec}",)


def test_missing_framework():
    advert = make_advert("cpu", frameworks=[("numpy", "2.4.6", ())])
    assert match(req(frameworks=["torch"]), advert) == ("torch is not installed in the job interpreter",)
    assert match(req(frameworks={"numpy": ">=2"}), advert) == ()


def test_every_missing_framework_is_reported():
    reasons = match(req(frameworks={"torch": ">=2", "mlx": ""}), CPU_PEER)
    assert set(reasons) == {"torch is not installed in the job interpreter",
                            "mlx is not installed in the job interpreter"}


# ---- match(): capabilities -----------------------------------------------------------------------------

@pytest.mark.parametrize("accelerator, peer_kind, framework, needed", [
    ("mps", "mps", "torch", "torch.mps"),
    ("gpu", "mps", "torch", "torch.mps"),
    ("cuda", "cuda", "torch", "torch.cuda"),
    ("gpu", "cuda", "torch", "torch.cuda"),
    ("mps", "mps", "mlx", "mlx.metal"),
    ("gpu", "mps", "mlx", "mlx.metal"),
    ("cuda", "cuda", "mlx", "mlx.cuda"),
    ("cpu", "cpu", "mlx", "mlx.cpu"),
    (None, "cpu", "mlx", "mlx.cpu"),
    ("cpu", "mps", "mlx", "mlx.cpu"),
])
def test_derived_capabilities(accelerator, peer_kind, framework, needed):
    others = {"torch.cuda", "torch.mps", "mlx.metal", "mlx.cuda", "mlx.cpu"} - {needed}
    r = req(accelerator=accelerator, frameworks={framework: ""})
    without = make_advert(peer_kind, frameworks=[(framework, "1.0", tuple(sorted(others)))])
    assert match(r, without) == (f"lacks capability {needed}",)
    with_it = make_advert(peer_kind, frameworks=[(framework, "1.0", (needed,))])
    assert match(r, with_it) == ()
    assert needed_capabilities(r, with_it) == {needed}


def test_gpu_task_with_torch_on_a_cuda_peer_needs_torch_cuda_not_torch_mps():
    r = req(accelerator="gpu", frameworks={"torch": ">=2"})
    assert needed_capabilities(r, CUDA_PEER) == {"torch.cuda"}
    assert needed_capabilities(r, MAC_PEER) == {"torch.mps"}
    cuda_torch_cpu_only = make_advert("cuda", frameworks=[TORCH_CPU])
    assert match(r, cuda_torch_cpu_only) == ("lacks capability torch.cuda",)


@pytest.mark.parametrize("accelerator", ["cpu", None])
def test_torch_on_cpu_needs_no_capability_even_on_a_gpu_peer(accelerator):
    r = req(accelerator=accelerator, frameworks={"torch": ">=2"})
    for kind in ("cuda", "mps", "cpu"):
        advert = make_advert(kind, frameworks=[TORCH_CPU])
        assert needed_capabilities(r, advert) == set()
        assert match(r, advert) == ()


def test_explicit_capabilities():
    advert = make_advert("cuda", frameworks=[("torch", "2.13.0", ("torch.cuda", "torch.cuda.bf16"))])
    assert match(req(capabilities="torch.cuda.bf16"), advert) == ()
    assert match(req(capabilities={"torch.cuda", "torch.cuda.bf16"}), advert) == ()
    assert match(req(capabilities=["flash-attn", "torch.cuda", "a.b"]), advert) == ("lacks capability a.b, flash-attn",)
    # explicit ones add to those derived from frameworks
    r = req(accelerator="cuda", frameworks={"torch": ""}, capabilities="x.y")
    assert needed_capabilities(r, advert) == {"torch.cuda", "x.y"}


def test_capabilities_are_only_reported_when_nothing_else_is_wrong():
    mac_no_torch = make_advert("mps")
    assert match(req(accelerator="mps", frameworks={"torch": ""}), mac_no_torch) == (
        "torch is not installed in the job interpreter",)
    mac_old_torch = make_advert("mps", frameworks=[("torch", "1.13.0", ())])
    assert match(req(accelerator="mps", frameworks={"torch": ">=2"}), mac_old_torch) == (
        "torch 1.13.0 does not satisfy >=2",)


# ---- match(): devices --------------------------------------------------------------------------------

@pytest.mark.parametrize("accelerator", ["mps", "gpu"])
def test_multi_device_refused_on_mps(accelerator):
    reasons = match(req(accelerator=accelerator, devices=2), MAC_PEER)
    assert reasons == ("devices=2: multi-device runs are unsupported on mps",)


def test_multi_device_refused_on_mps_even_if_it_claimed_a_distributed_backend():
    mac = make_advert("mps", distributed="nccl")
    assert "unsupported on mps" in reasons_text(match(req(accelerator="mps", devices=2), mac))


@pytest.mark.parametrize("devices, ok", [(1, True), (2, True), (4, True), (5, False), (8, False)])
def test_multi_device_needs_enough_cuda_devices(devices, ok):
    advert = make_advert("cuda", memory=(80.0,) * 4)
    reasons = match(req(accelerator="cuda", devices=devices), advert)
    assert (reasons == ()) is ok, reasons
    if not ok:
        assert reasons == (f"devices={devices}; peer has 4",)
    assert (match(req(accelerator="gpu", devices=devices), advert) == ()) is ok


def test_multi_device_refused_where_distributed_is_unsupported():
    advert = make_advert("cuda", memory=(80.0, 80.0), distributed="unsupported")
    assert match(req(accelerator="cuda", devices=2), advert) == (
        "devices=2: multi-device runs are unsupported on cuda",)


@pytest.mark.parametrize("accelerator", ["cpu", None])
def test_multi_device_needs_a_gpu_accelerator(accelerator):
    advert = make_advert("cuda", memory=(80.0, 80.0))
    assert match(req(accelerator=accelerator, devices=2), advert) == ("devices=2 needs a GPU accelerator",)


# ---- match(): peer filter and protocol --------------------------------------------------------------

def test_peer_filter_by_name_or_id():
    advert = make_advert("cuda", name="gpu-7", peer_id="3f2a9c")
    assert match(req(peer="gpu-7"), advert) == ()
    assert match(req(peer="3f2a9c"), advert) == ()
    assert match(req(peer="gpu-8"), advert) == ("not the requested peer 'gpu-8'",)
    assert match(req(peer="3f2a9"), advert) == ("not the requested peer '3f2a9'",)  # no prefix matching


@pytest.mark.parametrize("version", [0, PROTOCOL_VERSION + 1, 99])
def test_protocol_version_mismatch(version):
    advert = make_advert("cpu", version=version)
    assert match(req(), advert) == (f"speaks protocol v{version}, this submitter v{PROTOCOL_VERSION}",)


def test_all_reasons_are_listed_together():
    advert = make_advert("cpu", version=PROTOCOL_VERSION + 1, name="other")
    reasons = match(req(accelerator="cuda", frameworks=["torch"], peer="box"), advert)
    text = reasons_text(reasons)
    assert len(reasons) == 4
    for part in ("speaks protocol", "not the requested peer", "needs cuda", "torch is not installed"):
        assert part in text


# ---- rank_key ---------------------------------------------------------------------------------------

def ranked(r: Requirements, candidates):
    """Names of (advert, load, latency) candidates, best first."""
    return [a.name for a, load, lat in sorted(candidates, key=lambda c: rank_key(r, c[0], c[1], c[2]))]


def test_gpu_rank_least_loaded_ratio_first():
    r = req(accelerator="cuda")
    half = make_advert("cuda", name="half", slots=4)      # 2 of 4 busy: 0.5
    full = make_advert("cuda", name="full", slots=1)      # 1 of 1 busy: 1.0
    idle = make_advert("cuda", name="idle", slots=1, memory=(141.0,))
    assert ranked(r, [(full, 1, 0.0), (half, 2, 0.0), (idle, 0, 5.0)]) == ["idle", "half", "full"]


def test_gpu_rank_smallest_fitting_memory_then_latency():
    r = req(accelerator="cuda", gpu_memory_gb=20)
    big = make_advert("cuda", name="big", memory=(80.0,))
    small = make_advert("cuda", name="small", memory=(24.0,))
    mixed = make_advert("cuda", name="mixed", memory=(16.0, 48.0))  # only 48 fits
    near_small = make_advert("cuda", name="near-small", memory=(24.0,))
    order = ranked(r, [(big, 0, 0.0), (mixed, 0, 0.0), (small, 0, 0.3), (near_small, 0, 0.1)])
    assert order == ["near-small", "small", "mixed", "big"]
    assert rank_key(r, mixed, 0) == (False, 0.0, 48.0, False, 0.0)


def test_gpu_rank_puts_a_peer_where_the_memory_is_free_now_first():
    r = req(accelerator="cuda", gpu_memory_gb=8)
    card = make_advert("cuda", name="card", memory=(24.0,))
    full, idle, unknown = (rank_key(r, card, load, free_gb=free) for load, free in ((0, 4.0), (3, 16.0), (1, None)))
    assert idle < full and unknown < full  # a lighter load never beats memory free now; unknown counts as free
    assert unknown < idle  # among peers where it fits now, the lighter load wins


def test_a_verified_advert_wins_a_tie_but_never_beats_a_lighter_load():
    for acc in ("cuda", "cpu"):
        r = req(accelerator=acc)
        heard = make_advert(acc, name="heard")  # from mDNS only
        proven = make_advert(acc, name="proven")  # its advert came through a handshake
        keys = {"heard": rank_key(r, heard, 0, 0.0, verified=False), "proven": rank_key(r, proven, 0, 0.5)}
        assert min(keys, key=keys.get) == "proven"
        assert rank_key(r, heard, 0, 0.0, verified=False) < rank_key(r, proven, 1, 0.0)


def test_gpu_rank_load_beats_memory_and_latency():
    r = req(accelerator="gpu")
    tight_busy = make_advert("cuda", name="tight-busy", memory=(16.0,), slots=2)
    roomy_idle = make_advert("cuda", name="roomy-idle", memory=(80.0,), slots=2)
    assert ranked(r, [(tight_busy, 1, 0.0), (roomy_idle, 0, 9.0)]) == ["roomy-idle", "tight-busy"]


def test_gpu_rank_applies_to_mps_by_unified_memory():
    r = req(accelerator="gpu", gpu_memory_gb=8)
    mac36 = make_advert("mps", name="mac36", memory=(36.0,))
    mac128 = make_advert("mps", name="mac128", memory=(128.0,))
    assert ranked(r, [(mac128, 0, 0.0), (mac36, 0, 0.0)]) == ["mac36", "mac128"]
    assert rank_key(r, mac36, 0, 0.25) == (False, 0.0, 36.0, False, 0.25)


def test_gpu_rank_zero_slots_does_not_divide_by_zero():
    advert = make_advert("cuda", slots=0)
    assert rank_key(req(accelerator="cuda"), advert, 3)[1] == 3.0


@pytest.mark.parametrize("accelerator", ["cpu", None])
def test_cpu_rank_free_slot_first_then_no_gpu_then_load_then_latency(accelerator):
    r = req(accelerator=accelerator)
    cpu_full = make_advert("cpu", name="cpu-full", slots=2)              # 2/2: no free slot
    gpu_idle = make_advert("cuda", name="gpu-idle", slots=4)             # free slot, but a GPU
    cpu_busy = make_advert("cpu", name="cpu-busy", slots=4)              # free slot, 3/4
    cpu_light_far = make_advert("cpu", name="cpu-light-far", slots=4)    # free slot, 1/4, far
    cpu_light_near = make_advert("cpu", name="cpu-light-near", slots=4)  # free slot, 1/4, near
    mac_idle = make_advert("mps", name="mac-idle", slots=1)              # free slot, a GPU, farther
    order = ranked(r, [(cpu_full, 2, 0.0), (gpu_idle, 0, 0.0), (cpu_busy, 3, 0.0), (cpu_light_far, 1, 0.5),
                       (cpu_light_near, 1, 0.1), (mac_idle, 0, 0.1)])
    assert order == ["cpu-light-near", "cpu-light-far", "cpu-busy", "gpu-idle", "mac-idle", "cpu-full"]


def test_cpu_rank_full_peer_without_gpu_after_any_free_gpu_peer():
    r = req(accelerator="cpu")
    cpu_full = make_advert("cpu", name="cpu-full", slots=1)
    gpu_busyish = make_advert("cuda", name="gpu", slots=8)
    assert ranked(r, [(cpu_full, 1, 0.0), (gpu_busyish, 7, 1.0)]) == ["gpu", "cpu-full"]
    assert rank_key(r, cpu_full, 1, 0.0) == (True, False, 1.0, False, 0.0)


def test_cpu_task_on_gpu_peers_ranks_by_cpu_rules_not_memory():
    r = req(accelerator="cpu")
    key = rank_key(r, make_advert("cuda", memory=(80.0,), slots=2), 1, 0.2)
    assert key == (False, True, 0.5, False, 0.2)


# ---- the job interpreter's Python (issue 10, item 1) --------------------------------------------------

@pytest.mark.parametrize("python", [3.11, "3.11", ">=three", "python>=3", ["3.11"], b">=3"])
def test_build_rejects_a_bad_python_specifier(python):
    with pytest.raises(ValueError, match="python must be a PEP 440 specifier"):
        Requirements.build(python=python)


@pytest.mark.parametrize("code_python", ["3", "3.11.7", ">=3.11", 3.11, ""])
def test_build_rejects_a_bad_code_python(code_python):
    with pytest.raises(ValueError, match="code_python"):
        Requirements.build(code_python=code_python)


def test_python_requirements_are_shown():
    r = req(python=">=3.11,<3.12", code_python="3.11", uses=["torch"])
    assert str(r) == "{accelerator=any, python>=3.11,<3.12, code pickled by Python 3.11, uses torch}"
    assert req(python="") == req()


@pytest.mark.parametrize("spec, ok", [(">=3.11", True), ("==3.11.*", True), (">=3.12", False), ("<3.11", False)])
def test_python_specifier_against_the_job_interpreter(spec, ok):
    reasons = match(req(python=spec), make_advert(python="3.11.7"))
    assert (reasons == ()) is ok, reasons
    if not ok:
        assert reasons == (f"its job interpreter runs Python 3.11.7, not python{spec}",)


@pytest.mark.parametrize("python, ok", [("3.11.7", True), ("3.11.0rc1", True), ("3.12.1", False), ("3.9.18", False),
                                        ("", False)])
def test_code_shipped_by_value_needs_the_same_minor_version(python, ok):
    reasons = match(req(code_python="3.11"), make_advert(python=python))
    assert (reasons == ()) is ok, reasons
    if not ok:
        (reason,) = reasons
        assert reason.startswith(f"its job interpreter runs Python {python or '(unknown)'}, but the task ships "
                                 "functions by value as Python 3.11 code")
        assert "start the peer with --python pointing to a Python 3.11 interpreter, or a matching venv" in reason


# ---- frameworks the function uses (issue 10, item 2) -------------------------------------------------

@pytest.mark.parametrize("accelerator, peer_kind, framework, needed", [
    ("mps", "mps", "torch", "torch.mps"), ("gpu", "mps", "torch", "torch.mps"), ("cuda", "cuda", "torch", "torch.cuda"),
    ("gpu", "cuda", "torch", "torch.cuda"), ("mps", "mps", "mlx", "mlx.metal"),
])
def test_a_framework_the_function_uses_needs_its_gpu_backend(accelerator, peer_kind, framework, needed):
    r = req(accelerator=accelerator, uses=[framework])
    without = make_advert(peer_kind, frameworks=[(framework, "1.0", (f"{framework}.cpu",))])
    assert match(r, without) == (f"lacks capability {needed} (the function uses {framework})",)
    assert match(r, make_advert(peer_kind, frameworks=[(framework, "1.0", (needed,))])) == ()


@pytest.mark.parametrize("accelerator", ["cpu", None])
def test_a_framework_the_function_uses_needs_nothing_off_a_gpu(accelerator):
    assert match(req(accelerator=accelerator, uses=["torch", "mlx"]), MAC_PEER) == ()


# ---- frameworks= of any installed distribution (issue 10, item 7) -------------------------------------

def test_an_advert_from_txt_leaves_other_distributions_to_the_peer():
    own = make_advert("cpu", frameworks=[TORCH_CPU], distributions={"msgpack": "1.1.0", "Scikit_Learn": "1.5.2"})
    heard = Advert.from_txt(own.to_txt())
    assert heard == own and heard.distributions is None
    r = req(frameworks={"msgpack": ">=2", "coremltools": ""})
    assert match(r, heard) == ()  # the peer answers when it admits the task
    assert match(r, own) == ("coremltools is not installed in the job interpreter", "msgpack 1.1.0 does not satisfy >=2")
    assert match(req(frameworks=["mlx"]), heard) == ("mlx is not installed in the job interpreter",)  # probed


@pytest.mark.parametrize("name", ["scikit-learn", "scikit_learn", "Scikit.Learn", "SCIKIT-LEARN"])
def test_distribution_names_compare_as_pep_503_says(name):
    own = make_advert("cpu", distributions={"Scikit_Learn": "1.5.2"})
    assert match(req(frameworks={name: ">=1.5"}), own) == ()


def test_the_probed_frameworks_come_from_the_probe_or_the_override_only():
    """An override that hides torch hides it, whatever the distributions say."""
    own = make_advert("cpu", frameworks=[MLX_CPU], distributions={"torch": "2.13.0", "mlx": "0.32.4"})
    assert match(req(frameworks=["torch"]), own) == ("torch is not installed in the job interpreter",)
    assert match(req(frameworks={"mlx": ">=0.32"}), own) == ()
