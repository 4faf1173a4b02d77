"""The utilisation parsers on recorded readings (facts/utilisation/, see its README for what is a
reconstruction), the check of a sample from elsewhere, and the sampler on this machine."""

from __future__ import annotations

import json
import math
import shutil

import pytest
from recorded import FACTS_DIR

from gpulayer.resources.utilisation import (GB, NvmlReader, Sampler, clean_sample, parse_host, parse_ioreg,
                                            parse_nvml)

UTIL = FACTS_DIR / "utilisation"


def test_ioreg_of_an_m2_max_under_load():
    assert parse_ioreg((UTIL / "mac_m2_max_ioreg.txt").read_text()) == [
        {"index": 0, "util_percent": 63.0, "memory_used_gb": round(2390753280 / GB, 3), "memory_total_gb": None}]


def test_ioreg_of_an_idle_m1():
    [gpu] = parse_ioreg((UTIL / "mac_m1_idle_ioreg.txt").read_text())
    assert gpu["util_percent"] == 0.0 and gpu["memory_used_gb"] == 0.125


def test_ioreg_without_the_keys_reads_as_unknown():
    [gpu] = parse_ioreg((UTIL / "mac_intel_no_stats_ioreg.txt").read_text())
    assert gpu["util_percent"] is None and gpu["memory_used_gb"] is None


def test_ioreg_of_two_accelerators_and_of_nothing():
    one = (UTIL / "mac_m2_max_ioreg.txt").read_text()
    two = parse_ioreg(one + one.replace('"Device Utilization %"=63', '"Device Utilization %"=7'))
    assert [(g["index"], g["util_percent"]) for g in two] == [(0, 63.0), (1, 7.0)]
    assert parse_ioreg("") == [] and parse_ioreg("garbage\n\x00 {}") == []
    # out-of-range figures are clamped, not believed
    assert parse_ioreg('"PerformanceStatistics" = {"Device Utilization %"=250}')[0]["util_percent"] == 100.0


def test_nvml_of_the_h200():
    """Real NVML readings of the lent H200 (recorded 2026-12-04 by tests/hardware/record_nvml.py), idle and
    under a bf16 matmul loop: parsed here as the sampler parsed them there."""
    record = json.loads((UTIL / "nvml_h200.json").read_text())
    assert record["machine"]["gpu"] == "NVIDIA H200" and record["recorded"].startswith("2026-12-04")
    total = round(143771 * 2**20 / GB, 3)  # nvidia-smi's 143771 MiB
    for state, util, used in (("idle", {0.0}, 0.601), ("busy", {99.0, 100.0}, 1.588)):
        assert len(record[state]) == 3
        for reading in record[state]:
            [gpu] = parse_nvml(reading["nvml"])
            assert gpu["index"] == 0 and gpu["util_percent"] in util
            assert gpu["memory_used_gb"] == used and gpu["memory_total_gb"] == total
            # the Sampler on the machine produced the same GPU entry, in a sample that passes the check
            assert reading["sample"]["source"] == "nvml" and reading["sample"]["gpus"] == [gpu]
            assert clean_sample(reading["sample"]) == reading["sample"]


def test_nvml_with_fields_it_could_not_read():
    gpus = parse_nvml(json.loads((UTIL / "nvml_8x_h100_partial.json").read_text()))
    assert [g["util_percent"] for g in gpus] == [97.0, 95.0, 0.0, None, 12.0, 0.0, 0.0, 100.0]
    assert gpus[4]["memory_used_gb"] is None and gpus[4]["memory_total_gb"] is None
    assert gpus[7]["memory_used_gb"] == gpus[7]["memory_total_gb"] == round(85520809984 / GB, 3)


def test_host_from_psutil():
    host = parse_host(json.loads((UTIL / "host_psutil.json").read_text()))
    assert host == {"cpu_percent": 77.3, "ram_total_gb": round(25276071936 / GB, 3),
                    "ram_available_gb": round(24669077504 / GB, 3)}


def test_a_parsed_sample_survives_the_check():
    sample = {"t": 1.7e9, **parse_host(json.loads((UTIL / "host_psutil.json").read_text())), "source": "ioreg",
              "gpus": parse_ioreg((UTIL / "mac_m2_max_ioreg.txt").read_text())}
    assert clean_sample(sample) == sample


@pytest.mark.parametrize("bad", [None, "x", [], {"t": "now"}, {"t": math.nan}, {"t": True}, {"t": -5}])
def test_an_unusable_sample_is_none(bad):
    assert clean_sample(bad) is None


def test_hostile_fields_of_a_sample_are_dropped():
    clean = clean_sample({"t": 1.0, "cpu_percent": math.inf, "ram_total_gb": 1e30, "ram_available_gb": "9",
                          "source": "evil", "extra": "x" * 10**6,
                          "gpus": [{"index": -1, "util_percent": 101, "memory_used_gb": math.nan}] * 1000})
    assert clean["cpu_percent"] is None and clean["ram_total_gb"] is None and clean["ram_available_gb"] is None
    assert clean["source"] is None and "extra" not in clean and len(clean["gpus"]) == 64
    assert clean["gpus"][0] == {"index": None, "util_percent": None, "memory_used_gb": None, "memory_total_gb": None}


def test_the_sampler_on_this_machine():
    """Here NVML is absent (no library or no GPU) and so is ioreg: CPU and memory only, and no error."""
    if shutil.which("nvidia-smi") or shutil.which("ioreg"):
        pytest.skip("this machine has a GPU source; the hardware tests cover it")
    assert NvmlReader().available is False
    sampler = Sampler(interval=0.05)
    assert sampler.source is None and sampler.latest() is None
    sampler.start()
    try:
        from support import wait_until

        sample = wait_until(sampler.latest, timeout=10)
    finally:
        sampler.stop()
    assert sample["gpus"] == [] and 0 <= sample["cpu_percent"] <= 100
    assert 0 < sample["ram_available_gb"] <= sample["ram_total_gb"]
    assert clean_sample(sample) == sample
