"""Unit tests of gpulayer.serialization: cloudpickle with protocol-5 out-of-band buffers.

Covers plain objects and closures, zero-copy numpy arrays and torch tensors, and functions from the
submitter's own modules shipped by value with their file name kept (for remote tracebacks).
"""

from __future__ import annotations

import importlib
import pickle
import sys
import traceback
import uuid
import warnings

import numpy as np
import pytest

from gpulayer import serialization
from gpulayer.protocol import framing, messages
from gpulayer.serialization import OUT_OF_BAND_MIN, dumps, loads

torch = pytest.importorskip("torch")


def round_trip(obj, as_bytearray: bool = True):
    """dumps, then loads on copies of the buffers as they would arrive (bytearrays)."""
    data, buffers = dumps(obj)
    received = [bytearray(b) for b in buffers] if as_bytearray else [bytes(b) for b in buffers]
    return loads(data, received), data, buffers, received


# ---- plain objects and functions ----------------------------------------------------------------------

@pytest.mark.parametrize("obj", [
    None, 0, -1, 2 ** 100, 3.5, "text", b"bytes", bytearray(b"ba"), [1, [2, [3]]], (1, "a"),
    {"a": 1, 2: [None]}, {1, 2, 3}, frozenset({"x"}), complex(1, 2), range(3, 9, 2), ValueError("boom"),
])
def test_plain_objects_round_trip(obj):
    back, data, buffers, _ = round_trip(obj)
    assert buffers == []
    if isinstance(obj, BaseException):
        assert type(back) is type(obj) and back.args == obj.args
    else:
        assert back == obj and type(back) is type(obj)


def test_lambda_and_closure_round_trip():
    base = 10

    def make_adder(n):
        def add(x):
            return x + n + base
        return add

    square = lambda x: x * x  # noqa: E731
    add3 = make_adder(3)
    back_square, *_ = round_trip(square)
    back_add3, *_ = round_trip(add3)
    assert back_square(7) == 49
    assert back_add3(1) == 14
    assert back_add3.__code__.co_filename == __file__


def test_nested_structures_of_functions_and_data():
    payload = {"fns": [abs, lambda s: s.upper()], "arr": np.arange(3)}
    back, *_ = round_trip(payload)
    assert back["fns"][0] is abs
    assert back["fns"][1]("ok") == "OK"
    assert np.array_equal(back["arr"], [0, 1, 2])


def test_loads_without_buffers_for_in_band_data():
    data, buffers = dumps({"k": [1, 2]})
    assert buffers == [] and loads(data) == {"k": [1, 2]}


# ---- numpy: out of band, zero copy -------------------------------------------------------------------

def test_large_numpy_array_travels_out_of_band_and_shares_memory():
    arr = np.arange(OUT_OF_BAND_MIN // 8 * 4, dtype=np.float64)  # 256 KiB
    back, data, buffers, received = round_trip(arr)
    assert len(buffers) == 1 and buffers[0].nbytes == arr.nbytes
    assert len(data) < 1000  # only the header is in the pickle
    assert np.array_equal(back, arr) and back.dtype == arr.dtype
    view = np.frombuffer(received[0], dtype=np.uint8)
    assert np.shares_memory(back, view)
    assert back.flags.writeable
    received[0][:8] = np.float64(-1.0).tobytes()  # writing the buffer shows through the array
    assert back[0] == -1.0


def test_dumps_does_not_copy_the_array():
    arr = np.ones(OUT_OF_BAND_MIN, dtype=np.uint8)
    _, buffers = dumps(arr)
    assert np.shares_memory(np.frombuffer(buffers[0], dtype=np.uint8), arr)


@pytest.mark.parametrize("nbytes, out_of_band", [(OUT_OF_BAND_MIN - 1, False), (OUT_OF_BAND_MIN, True),
                                                (100, False), (0, False), (3 * OUT_OF_BAND_MIN + 7, True)])
def test_threshold_of_64_kib(nbytes, out_of_band):
    arr = np.full(nbytes, 7, dtype=np.uint8)
    back, data, buffers, _ = round_trip(arr)
    assert bool(buffers) is out_of_band
    assert len(data) < 1000 if out_of_band else len(data) >= nbytes
    assert np.array_equal(back, arr)


def test_small_array_stays_in_band():
    arr = np.arange(100, dtype=np.int32)
    back, data, buffers, _ = round_trip(arr)
    assert buffers == [] and np.array_equal(back, arr)


def test_several_arrays_in_one_object_keep_their_order():
    arrays = [np.full(OUT_OF_BAND_MIN, i, dtype=np.uint8) for i in range(3)] + [np.arange(5)]
    back, _, buffers, received = round_trip({"a": arrays})
    assert len(buffers) == 3
    for i in range(3):
        assert np.all(back["a"][i] == i)
        assert np.shares_memory(back["a"][i], np.frombuffer(received[i], dtype=np.uint8))
    assert np.array_equal(back["a"][3], np.arange(5))


@pytest.mark.parametrize("make", [
    lambda: np.arange(200_000, dtype=np.float64)[::3],            # strided
    lambda: np.arange(200_000, dtype=np.int32).reshape(400, 500).T,  # Fortran order: contiguous, transposed
    lambda: np.arange(200_000, dtype=np.int32).reshape(400, 500)[:, ::2],
    lambda: np.arange(120_000, dtype=np.float32).reshape(300, 400)[::-1],
])
def test_non_contiguous_arrays(make):
    arr = make()
    back, *_ = round_trip(arr)
    assert np.array_equal(back, arr) and back.dtype == arr.dtype and back.shape == arr.shape


def test_fortran_ordered_array_stays_out_of_band_and_fortran():
    arr = np.asfortranarray(np.arange(100_000, dtype=np.float64).reshape(200, 500))
    back, _, buffers, _ = round_trip(arr)
    assert len(buffers) == 1
    assert back.flags.f_contiguous and np.array_equal(back, arr)


def test_structured_and_object_arrays():
    rec = np.zeros(10_000, dtype=[("a", "i4"), ("b", "f8")])
    rec["a"] = np.arange(10_000)
    back, _, buffers, _ = round_trip(rec)
    assert len(buffers) == 1 and np.array_equal(back, rec)
    objs = np.array([{"x": 1}, None, "s"], dtype=object)
    back, _, buffers, _ = round_trip(objs)
    assert buffers == [] and list(back) == list(objs)


def test_large_pickle_buffer_travels_out_of_band():
    blob = bytearray(b"z" * (2 * OUT_OF_BAND_MIN))
    data, buffers = dumps(pickle.PickleBuffer(blob))
    assert len(buffers) == 1 and len(data) < 100
    assert bytes(loads(data, [bytearray(b) for b in buffers])) == bytes(blob)


@pytest.mark.parametrize("kind", [bytes, bytearray])
def test_large_bytes_and_bytearray_round_trip(kind):
    blob = kind(b"z" * (2 * OUT_OF_BAND_MIN))
    back, *_ = round_trip(blob)
    assert back == blob and type(back) is kind


@pytest.mark.parametrize("kind", [bytes, bytearray])
def test_large_bytes_like_objects_are_copied_in_band_as_documented(kind):
    data, buffers = dumps(kind(2 * OUT_OF_BAND_MIN))
    assert buffers == [] and len(data) > 2 * OUT_OF_BAND_MIN


def test_a_pickle_buffer_travels_out_of_band():
    payload = bytearray(2 * OUT_OF_BAND_MIN)
    data, buffers = dumps(pickle.PickleBuffer(payload))
    assert len(buffers) == 1 and len(data) < 1000


@pytest.mark.parametrize("n_floats", [OUT_OF_BAND_MIN // 8, 100_000 // 8])
def test_arrays_received_over_the_wire_are_writable(n_floats):
    arr = np.zeros(n_floats)
    data, buffers = dumps(arr)
    stream = b"".join(bytes(p) for p in framing.encode({"t": messages.RESULT, "data": data}, buffers))
    reader = framing.MessageReader(1 << 20)
    target = reader.buffer()
    target[:len(stream)] = stream
    reader.feed(len(stream))
    msg, received = reader.messages.popleft()
    back = loads(msg["data"], received)
    assert back.flags.writeable


@pytest.mark.parametrize("n_floats", [10, 200_000])
def test_arrays_received_over_the_wire_small_or_big_are_writable(n_floats):
    arr = np.zeros(n_floats)
    data, buffers = dumps(arr)
    parts = framing.encode({"t": messages.RESULT, "data": data}, buffers)
    reader = framing.MessageReader(1 << 22)
    for part in parts:
        part = memoryview(part)
        while part.nbytes:
            target = reader.buffer()
            n = min(len(target), part.nbytes)
            target[:n] = part[:n]
            reader.feed(n)
            part = part[n:]
    msg, received = reader.messages.popleft()
    back = loads(msg["data"], received)
    assert back.flags.writeable and np.array_equal(back, arr)


# ---- torch tensors ----------------------------------------------------------------------------------

@pytest.mark.parametrize("make", [
    lambda: torch.arange(10, dtype=torch.float32) / 3,
    lambda: torch.arange(-5, 5, dtype=torch.int64),
    lambda: (torch.arange(12, dtype=torch.float32) / 7).to(torch.bfloat16).reshape(3, 4),
    lambda: torch.tensor(3.25),
    lambda: torch.zeros(0, 4),
    lambda: torch.tensor([True, False]),
    lambda: torch.arange(6, dtype=torch.float16).reshape(2, 3),
    lambda: torch.arange(4, dtype=torch.uint8),
])
def test_small_tensors_round_trip(make):
    t = make()
    back, _, buffers, _ = round_trip(t)
    assert buffers == []
    assert type(back) is torch.Tensor
    assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bfloat16, torch.float16, torch.float64])
def test_large_tensors_travel_out_of_band_zero_copy(dtype):
    t = torch.arange(100_000).to(dtype)
    back, data, buffers, received = round_trip(t)
    assert len(buffers) == 1 and buffers[0].nbytes == t.numel() * t.element_size()
    assert len(data) < 1000
    assert back.dtype == dtype and torch.equal(back, t)
    raw = torch.frombuffer(received[0], dtype=torch.uint8)
    assert back.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr()


def test_requires_grad_is_kept():
    t = torch.randn(4, 5, requires_grad=True)
    back, *_ = round_trip(t)
    assert back.requires_grad and back.is_leaf and back.grad is None
    assert torch.equal(back.detach(), t.detach())
    back.sum().backward()
    assert torch.equal(back.grad, torch.ones(4, 5))


def test_requires_grad_large_bf16_tensor():
    t = torch.randn(300, 300).to(torch.bfloat16).requires_grad_(True)
    back, _, buffers, _ = round_trip(t)
    assert len(buffers) == 1
    assert back.dtype == torch.bfloat16 and back.requires_grad and torch.equal(back.detach(), t.detach())


def test_non_leaf_tensor_arrives_as_a_leaf_with_the_same_values():
    a = torch.randn(3, requires_grad=True)
    b = a * 2
    back, *_ = round_trip(b)
    assert back.requires_grad and back.is_leaf and torch.equal(back.detach(), b.detach())


def test_non_contiguous_tensor():
    t = torch.arange(200_000, dtype=torch.float32).reshape(400, 500).T
    back, *_ = round_trip(t)
    assert torch.equal(back, t) and back.shape == (500, 400)


def test_tensor_view_of_a_bigger_storage_sends_only_the_view():
    base = torch.arange(1_000_000, dtype=torch.float32)
    view = base[:10]
    _, data, buffers, _ = round_trip(view)
    assert buffers == [] and len(data) < 1000


def test_tensor_in_band_without_numpy_twin_falls_back():
    t = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64)
    back, *_ = round_trip(t)
    assert torch.equal(back, t)


def test_parameter_and_module_round_trip():
    lin = torch.nn.Linear(3, 2)
    back, *_ = round_trip(lin)
    assert isinstance(back.weight, torch.nn.Parameter)
    assert torch.equal(back.weight, lin.weight) and torch.equal(back.bias, lin.bias)


def test_loaded_tensor_from_bytearray_buffers_warns_nothing():
    t = torch.ones(100_000)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        back, *_ = round_trip(t)
    back += 1  # writable
    assert torch.all(back == 2)


# ---- local modules shipped by value, file names kept ---------------------------------------------------

@pytest.fixture
def local_module(tmp_path, monkeypatch):
    """A module of 'the user's own code' in a temp dir, imported from there; yields (module, path)."""
    name = f"gl_user_tasks_{uuid.uuid4().hex[:10]}"
    path = tmp_path / f"{name}.py"
    path.write_text(
        "SCALE = 3\n"
        "\n"
        "def helper(x):\n"
        "    return x * SCALE\n"
        "\n"
        "def task(x):\n"
        "    return helper(x) + 1\n"
        "\n"
        "boom = lambda: 1 / 0\n"
        "\n"
        "class Point:\n"
        "    def __init__(self, x):\n"
        "        self.x = x\n"
        "    def norm(self):\n"
        "        return abs(self.x)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module(name)
    yield module, path
    sys.modules.pop(name, None)


def _forget(module):
    """Make the module unimportable here, as it would be on a peer."""
    sys.modules.pop(module.__name__, None)
    sys.path[:] = [p for p in sys.path if p != str(module.__file__).rsplit("/", 1)[0]]
    importlib.invalidate_caches()


def test_local_module_function_is_shipped_by_value(local_module):
    module, path = local_module
    data, buffers = dumps(module.task)
    _forget(module)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(module.__name__)
    fn = loads(data, buffers)
    assert fn(2) == 7
    assert fn.__code__.co_filename == str(path)
    assert fn.__globals__["helper"].__code__.co_filename == str(path)


def test_local_module_lambda_keeps_its_file_and_line(local_module):
    module, path = local_module
    data, buffers = dumps(module.boom)
    _forget(module)
    fn = loads(data, buffers)
    assert fn.__code__.co_filename == str(path)
    assert fn.__code__.co_firstlineno == 9
    with pytest.raises(ZeroDivisionError) as info:
        fn()
    last = traceback.extract_tb(info.value.__traceback__)[-1]
    assert last.filename == str(path) and last.lineno == 9


def test_local_module_class_is_shipped_by_value(local_module):
    module, path = local_module
    data, buffers = dumps(module.Point(-4))
    _forget(module)
    point = loads(data, buffers)
    assert point.norm() == 4
    assert type(point).norm.__code__.co_filename == str(path)


def test_plain_pickle_of_the_local_function_would_need_the_module(local_module):
    """The control: by reference, the module is needed on the other side."""
    module, _ = local_module
    data = pickle.dumps(module.task)
    _forget(module)
    with pytest.raises(ModuleNotFoundError):
        pickle.loads(data)


def test_installed_packages_are_pickled_by_reference():
    data, _ = dumps(np.mean)
    assert len(data) < 200 and b"numpy" in data
    assert loads(data) is np.mean
    assert loads(dumps(serialization.dumps)[0]) is serialization.dumps


def test_code_with_filename_helper():
    code = (lambda: 42).__code__
    data, _ = dumps(code)
    back = loads(data)
    assert back.co_filename == code.co_filename == __file__
    assert serialization._code_with_filename(serialization._code_reduce()(code)[1], "/x/y.py").co_filename == "/x/y.py"
