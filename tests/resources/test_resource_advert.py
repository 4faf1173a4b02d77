"""Detected resources survive the mDNS TXT record and fit its size limits."""

from pathlib import Path

import pytest

from gpulayer.resources.detect import parse_facts
from gpulayer.resources.model import TXT_VALUE_MAX, Advert
from gpulayer.resources.override import apply_override

RECORD_MAX = 1300  # bytes of the whole TXT record (one length byte + "key=value" per entry)

FACTS = sorted(path.stem for path in Path(__file__).with_name("facts").glob("*.json"))


def advert(res):
    return Advert.from_resources(res, peer_id="3f9c2a7d1b8e4c60", name=res.host, cluster="lab", slots=2)


@pytest.mark.parametrize("name", FACTS)
def test_txt_round_trip_and_size(load_facts, name):
    original = advert(parse_facts(load_facts(name)))
    txt = original.to_txt()
    entries = [f"{k}={v}".encode() for k, v in txt.items()]
    assert max(map(len, entries)) <= TXT_VALUE_MAX
    assert sum(1 + len(e) for e in entries) < RECORD_MAX
    assert Advert.from_txt(txt) == original
    assert Advert.from_txt({k.encode(): v.encode() for k, v in txt.items()}) == original


def test_mac_advert(load_facts):
    ad = advert(parse_facts(load_facts("mac_m2_max")))
    assert (ad.accelerator, ad.memory_kind, ad.device_memory_gb) == ("mps", "unified", (32.0,))
    assert ad.validation == "hardware-validated"
    assert ad.capabilities == {"torch.cpu", "torch.mps", "mlx.cpu", "mlx.metal"}


def test_override_advert(load_facts):
    mac = {"devices": [{"kind": "mps", "name": "Apple M4 GPU (MPS)", "memory_gb": 24}]}
    res = apply_override(parse_facts(load_facts("linux_cpu_mlx")), mac, "mac.json")
    ad = advert(res)
    assert (ad.accelerator, ad.validation) == ("mps", "override")
    assert Advert.from_txt(ad.to_txt()) == ad


def test_json_keeps_the_reported_key_independent(load_facts):
    res = parse_facts(load_facts("mac_m2_max"))
    assert res.devices[0].validation == "hardware-validated"
    device = res.to_dict()["devices"][0]
    assert device["independent"] == "hardware-validated" and "validation" not in device
