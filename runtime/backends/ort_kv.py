"""KV caches for the ONNX Runtime backend: numpy arrays on the host, or OrtValues kept on the
execution provider's device through IO binding.

An optimum-exported decoder returns ``present.N.*`` = concat(past, new) along the time axis, so a
sequence's cache is the present of its last run cut to the kept length, one (1, kv_heads, T,
head_dim) tensor per layer and key/value. Both stores offer the same operations:

- ``run``: one session run on batched caches; returns host logits and the new presents;
- ``batch`` / ``row``: stack several sequences' caches as batch rows, take one row back out;
- ``cut``: positions [lo, hi) of a cache (rollback and copy are cuts);
- ``join``: two caches one after the other in time.

On the host these are numpy views and concatenations. On a device they are tiny ONNX graphs
(Slice, Concat) run by the same execution provider, so between steps only the token ids, the
attention mask and the logits cross the bus.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
from numpy.typing import DTypeLike

KV = list[Any]  # one tensor per past input, in the session's input order


class HostKV:
    """Caches as numpy arrays; ``session.run`` copies them in and returns fresh presents."""

    def __init__(self, sess: Any, past_names: list[str], shape: tuple[int, int], dtype: DTypeLike):
        self._sess, self._past = sess, past_names
        self._empty = [np.zeros((1, shape[0], 0, shape[1]), dtype)] * len(past_names)

    def empty(self) -> KV:
        return list(self._empty)

    def run(self, feed: dict[str, np.ndarray], past: KV) -> tuple[np.ndarray, KV]:
        logits, *presents = self._sess.run(None, {**feed, **dict(zip(self._past, past))})
        return np.asarray(logits), presents

    def batch(self, caches: list[KV]) -> KV:
        return [np.concatenate(layer, axis=0) for layer in zip(*caches)]

    def row(self, kv: KV, k: int) -> KV:
        return [a[k : k + 1] for a in kv]

    def cut(self, kv: KV, lo: int, hi: int) -> KV:
        return [a[:, :, lo:hi] for a in kv]

    def join(self, a: KV, b: KV) -> KV:
        return [np.concatenate(pair, axis=2) for pair in zip(a, b)]


class DeviceKV:
    """Caches as OrtValues on ``device`` ("cuda" or "cpu"); runs bind them in place."""

    def __init__(
        self,
        sess: Any,
        past_names: list[str],
        shape: tuple[int, int],
        dtype: DTypeLike,
        device: str,
        providers: list[Any],
        device_id: int = 0,
    ):
        import onnxruntime as ort

        self._ort, self._sess, self._past = ort, sess, past_names
        self._device, self._id, self._providers = device, device_id, providers
        self._outputs = [o.name for o in sess.get_outputs()]
        self._dtype = np.dtype(dtype)
        self._empty = [
            ort.OrtValue.ortvalue_from_numpy(np.zeros((1, shape[0], 0, shape[1]), dtype), device, device_id)
            for _ in past_names
        ]
        self._graphs: dict[tuple[str, int, int], Any] = {}

    def empty(self) -> KV:
        return list(self._empty)

    def run(self, feed: dict[str, np.ndarray], past: KV) -> tuple[np.ndarray, KV]:
        io = self._sess.io_binding()
        for name, value in feed.items():
            io.bind_cpu_input(name, value)
        for name, value in zip(self._past, past):
            io.bind_ortvalue_input(name, value)
        io.bind_output(self._outputs[0], "cpu")  # logits go to the host for sampling
        for name in self._outputs[1:]:
            io.bind_output(name, self._device, self._id)
        self._sess.run_with_iobinding(io)
        logits, *presents = io.get_outputs()
        return logits.numpy(), presents

    def batch(self, caches: list[KV]) -> KV:
        return self._apply(("concat", 0, len(caches)), [v for layer in zip(*caches) for v in layer])

    def row(self, kv: KV, k: int) -> KV:
        return self._slice(kv, k, k + 1, 0)

    def cut(self, kv: KV, lo: int, hi: int) -> KV:
        return self._slice(kv, lo, hi, 2)

    def join(self, a: KV, b: KV) -> KV:
        return self._apply(("concat", 2, 2), [v for pair in zip(a, b) for v in pair])

    # -- helper graphs, built once per shape of operation ----------------------------------------
    def _slice(self, kv: KV, lo: int, hi: int, axis: int) -> KV:
        bounds = {"starts": np.array([lo], np.int64), "ends": np.array([hi], np.int64)}
        return self._apply(("slice", axis, 1), kv, bounds)

    def _apply(self, op: tuple[str, int, int], values: KV, cpu_inputs: Optional[dict[str, np.ndarray]] = None) -> KV:
        sess = self._graphs.get(op) or self._graphs.setdefault(op, self._build(*op))
        io = sess.io_binding()
        for i, value in enumerate(values):
            io.bind_ortvalue_input(f"x{i}", value)
        for name, value in (cpu_inputs or {}).items():
            io.bind_cpu_input(name, value)
        for o in sess.get_outputs():
            io.bind_output(o.name, self._device, self._id)
        sess.run_with_iobinding(io)
        return list(io.get_outputs())

    def _build(self, kind: str, axis: int, n: int) -> Any:
        """A graph over the len(past) cache tensors: Slice each on ``axis`` by the starts/ends
        inputs (n = 1), or Concat every n consecutive inputs on ``axis``."""
        from onnx import TensorProto, helper

        elem = helper.np_dtype_to_tensor_dtype(self._dtype)
        count = len(self._past)
        xs = [helper.make_tensor_value_info(f"x{i}", elem, None) for i in range(count * n)]
        ys = [helper.make_tensor_value_info(f"y{i}", elem, None) for i in range(count)]
        if kind == "slice":
            extra = [helper.make_tensor_value_info(k, TensorProto.INT64, [1]) for k in ("starts", "ends")]
            nodes = [
                helper.make_node(
                    "Constant", [], ["axes"], value=helper.make_tensor("a", TensorProto.INT64, [1], [axis])
                )
            ]
            nodes += [helper.make_node("Slice", [f"x{i}", "starts", "ends", "axes"], [f"y{i}"]) for i in range(count)]
        else:
            extra = []
            nodes = [
                helper.make_node("Concat", [f"x{i * n + j}" for j in range(n)], [f"y{i}"], axis=axis)
                for i in range(count)
            ]
        graph = helper.make_graph(nodes, f"kv_{kind}_{axis}_{n}", xs + extra, ys)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        return self._ort.InferenceSession(model.SerializeToString(), providers=self._providers)
