"""qkv inside torch.compile, torch.export, FakeTensor and meta tensors.

Every case compiles with ``fullgraph=True`` (a graph break is an error) and counts graph breaks
with ``torch._dynamo.utils.counters``; results and gradients are compared with eager at the
dtype's tolerance. Most cases compile with the "aot_eager" backend (dynamo's trace, AOT autograd
and functionalisation over fake tensors, without inductor's code generation, which costs seconds
per graph); one module and the KV cache compile with inductor too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

import qkv
from qkv import _tracing
from qkv.backends.flash import kernel
from tests.oracle import TOLERANCE

B, H, L, D = 2, 4, 40, 16


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _inputs(seed: int = 0, hkv: int = H, lk: int = L) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, D, generator=g).requires_grad_()
    k = torch.randn(B, hkv, lk, D, generator=g).requires_grad_()
    v = torch.randn(B, hkv, lk, D, generator=g).requires_grad_()
    return q, k, v


def _graph_breaks() -> int:
    return sum(counters["graph_break"].values())


class _Graphs:
    """A dynamo backend that keeps the FX graphs it is given."""

    def __init__(self, then: str | None = None) -> None:
        self.graphs: list[torch.fx.GraphModule] = []
        self.then = then  # a dynamo backend that compiles the graphs, or None: run them as given

    def __call__(self, gm: torch.fx.GraphModule, inputs: Any) -> Callable[..., Any]:
        self.graphs.append(gm)
        if self.then is None:
            return gm.forward
        compiled: Callable[..., Any] = torch._dynamo.lookup_backend(self.then)(gm, inputs)
        return compiled

    def targets(self) -> list[Any]:
        return [node.target for gm in self.graphs for node in gm.graph.nodes]


def _padding() -> torch.Tensor:
    keep = torch.ones(B, 1, 1, L, dtype=torch.bool)
    keep[0, ..., -7:] = False
    return keep


ARGUMENTS: dict[str, Callable[[], dict[str, Any]]] = {
    "causal": lambda: {"causal": True},
    "bool mask": lambda: {"mask": _padding()},
    "float mask": lambda: {"mask": torch.zeros(L, L).masked_fill(torch.rand(L, L) < 0.3, -1e9)},
    "causal + padding": lambda: {"causal": True, "mask": _padding()},
    "window": lambda: {"causal": True, "window": 8},
    "segments": lambda: {"causal": True, "segments": torch.arange(L) // 13},
    "softcap": lambda: {"causal": True, "softcap": 3.0},
    "alibi": lambda: {"causal": True, "alibi_slopes": torch.rand(H).requires_grad_()},
    "sinks": lambda: {"causal": True, "sinks": torch.randn(H).requires_grad_()},
    "return_lse": lambda: {"causal": "bottom-right", "return_lse": True},
    "all rules": lambda: {
        "causal": True,
        "window": (9, 0),
        "softcap": 4.0,
        "alibi_slopes": torch.rand(H).requires_grad_(),
        "sinks": torch.randn(H).requires_grad_(),
        "segments": torch.arange(L) // 17,
    },
}
_SDPA_CANNOT = {"softcap", "sinks", "return_lse", "all rules", "alibi"}  # (learnable slopes)


def _loss(result: Any) -> torch.Tensor:
    parts = result if isinstance(result, tuple) else (result,)
    return sum(((p.float() * (i + 1)) ** 2).sum() for i, p in enumerate(parts))  # type: ignore[return-value]


def _grads(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    grads = [t.grad.clone() for t in tensors if t.grad is not None]
    for t in tensors:
        t.grad = None
    return grads


@pytest.mark.parametrize("backend", ["flash", "auto", "reference", "sdpa"])
@pytest.mark.parametrize("name", list(ARGUMENTS))
def test_attention_compiles_whole_and_equals_eager(backend: str, name: str) -> None:
    if backend == "sdpa" and name in _SDPA_CANNOT:
        pytest.skip("sdpa refuses this call eagerly too")
    q, k, v = _inputs()
    kwargs = ARGUMENTS[name]()
    leaves = [
        q,
        k,
        v,
        *(x for x in kwargs.values() if isinstance(x, torch.Tensor) and x.requires_grad),
    ]

    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
        return qkv.attention(q, k, v, backend=backend, **kwargs)

    eager = f(q, k, v)
    _loss(eager).backward()
    eager_grads = _grads(leaves)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v)
    _loss(compiled).backward()
    compiled_grads = _grads(leaves)

    assert _graph_breaks() == 0
    atol, rtol = TOLERANCE[torch.float32]
    for a, b in zip(
        eager if isinstance(eager, tuple) else (eager,),
        compiled if isinstance(compiled, tuple) else (compiled,),
        strict=True,
    ):
        torch.testing.assert_close(b, a, atol=atol, rtol=rtol)
    assert len(compiled_grads) == len(eager_grads) == len(leaves)
    for a, b in zip(eager_grads, compiled_grads, strict=True):
        torch.testing.assert_close(b, a, atol=10 * atol, rtol=10 * rtol)


@pytest.mark.parametrize("name", ["causal", "bool mask", "all rules"])
def test_flash_is_one_custom_operator_in_the_graph(name: str) -> None:
    q, k, v = _inputs()
    kwargs = ARGUMENTS[name]()
    graphs = _Graphs()
    compiled = torch.compile(
        lambda q, k, v: qkv.attention(q, k, v, backend="flash", **kwargs),
        backend=graphs,
        fullgraph=True,
    )
    compiled(q, k, v)
    targets = graphs.targets()
    op = torch.ops.qkv.attention
    assert sum(target in (op, op.default) for target in targets) == 1
    # the tiles' Python loop is not in the graph: no matrix product outside the operator
    assert torch.ops.aten.matmul.default not in targets and torch.matmul not in targets


def test_grouped_query_heads_compile() -> None:
    q, k, v = _inputs(hkv=2)
    f = lambda q, k, v: qkv.attention(q, k, v, causal=True)  # noqa: E731
    eager = f(q, k, v)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v)
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)
    assert _graph_breaks() == 0


def test_dynamic_sequence_length_compiles_once() -> None:
    """dynamic=True: one graph serves every length (no recompilation per length)."""
    graphs = _Graphs()
    f = lambda q, k, v: qkv.attention(q, k, v, causal=True, backend="flash")  # noqa: E731
    compiled = torch.compile(f, backend=graphs, fullgraph=True, dynamic=True)
    for length in (24, 40, 57):
        q, k, v = (torch.randn(B, H, length, D) for _ in range(3))
        torch.testing.assert_close(compiled(q, k, v), f(q, k, v), atol=1e-5, rtol=1e-5)
    assert len(graphs.graphs) == 1
    assert _graph_breaks() == 0


@pytest.mark.parametrize("module", ["SelfAttention", "MultiheadAttention"])
def test_modules_compile_whole_forward_and_backward(module: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(B, L, 32)
    if module == "SelfAttention":
        layer = qkv.SelfAttention(32, heads=4, causal=True)
        call: Callable[[torch.Tensor], torch.Tensor] = layer
    else:
        mha = qkv.MultiheadAttention(32, 4, batch_first=True)
        call = lambda x: mha(x, x, x, need_weights=False)[0]  # noqa: E731
        layer = mha
    eager = call(x)
    eager.square().sum().backward()
    eager_grads = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    compiled = torch.compile(call, fullgraph=True)(x)  # inductor
    compiled.square().sum().backward()
    assert _graph_breaks() == 0
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-4)
    for a, p in zip(eager_grads, layer.parameters(), strict=True):
        torch.testing.assert_close(p.grad, a, atol=1e-4, rtol=1e-4)


def test_kv_cache_decoding_compiles_and_writes_the_cache() -> None:
    """The decoding step's kernel (which writes the cache's buffers in place) as a custom
    operator that declares the write: the compiled steps equal the eager ones, cache included,
    and 40 steps take a new graph only where the cache grows its buffers."""
    torch.manual_seed(0)
    prompt, steps = 12, 40
    k_all, v_all, q_all = (torch.randn(1, H, prompt + steps, D) for _ in range(3))

    def run(step: Callable[..., torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
        cache = qkv.KVCache()
        outs = [step(q_all[..., :prompt, :], k_all[..., :prompt, :], v_all[..., :prompt, :], cache)]
        for t in range(prompt, prompt + steps):
            s = slice(t, t + 1)
            outs.append(step(q_all[..., s, :], k_all[..., s, :], v_all[..., s, :], cache))
        return outs, cache.keys

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: qkv.KVCache) -> Any:
        return qkv.attention_with_cache(q, k, v, cache, causal=True)

    eager, eager_keys = run(step)
    graphs = _Graphs(then="aot_eager")
    compiled, compiled_keys = run(torch.compile(step, backend=graphs, fullgraph=True))
    assert _graph_breaks() == 0
    assert len(graphs.graphs) <= 8  # the prompt, the first steps, each growth: not one per step
    torch.testing.assert_close(compiled_keys, eager_keys)
    for a, b in zip(eager, compiled, strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


def test_fake_and_meta_tensors_give_shapes_and_dtypes() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.randn(2, 8, 100, 32, dtype=torch.bfloat16)
        kv = torch.randn(2, 2, 130, 32, dtype=torch.bfloat16)
        out = qkv.attention(q, kv, kv, causal=True, backend="flash")
        out_auto, lse = qkv.attention(q, kv, kv, window=(16, 0), return_lse=True)
    assert out.shape == (2, 8, 100, 32) and out.dtype == torch.bfloat16
    assert out_auto.shape == (2, 8, 100, 32) and lse.shape == (2, 8, 100)
    meta = torch.empty(1, 4, 64, 16, device="meta")
    out = qkv.attention(meta, meta, meta, causal=True, backend="flash")
    assert out.device.type == "meta" and out.shape == (1, 4, 64, 16)


def test_the_operators_pass_torch_opcheck() -> None:
    """torch.library.opcheck: schema, fake implementations, autograd registration and
    torch.compile agree with the operators' real runs."""
    q, k, v = (x.detach().requires_grad_() for x in _inputs(hkv=2))
    slopes, sinks = torch.rand(H).requires_grad_(), torch.randn(H).requires_grad_()
    ids = torch.arange(L) // 11
    cases = [
        (q, k, v, None, 0.25, 0, None, None, None, None, None, None),
        (q, k, v, _padding(), 0.25, None, None, None, None, None, None, None),
        (q, k, v, None, 0.25, 0, -9, ids, ids, 3.0, slopes, sinks),
    ]
    for args in cases:
        torch.library.opcheck(torch.ops.qkv.attention.default, args)
    keys, values = torch.zeros(1, 2, 20, D), torch.zeros(1, 2, 20, D)
    step = (torch.randn(1, H, 1, D), torch.randn(1, 2, 1, D), torch.randn(1, 2, 1, D))
    torch.library.opcheck(torch.ops.qkv.decode_step.default, (*step, keys, values, 7, 0.25, 7))


def test_export_self_attention_causal_with_padding() -> None:
    torch.manual_seed(0)
    layer = qkv.SelfAttention(32, heads=4, causal=True).eval()
    x, keep = torch.randn(2, L, 32), _padding()[:, 0, 0, :]

    class WithPadding(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = layer

        def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
            return self.layer(x, mask=keep[:, None, None, :])

    model = WithPadding()
    program = torch.export.export(model, (x, keep))
    assert any(node.target == torch.ops.qkv.attention.default for node in program.graph.nodes) or (
        not kernel.available()
    )
    x2 = torch.randn(2, L, 32)
    torch.testing.assert_close(program.module()(x2, keep), model(x2, keep), atol=1e-5, rtol=1e-5)


def test_export_a_transformers_llama_on_qkv() -> None:
    transformers = pytest.importorskip("transformers")
    from qkv.integrations.huggingface import register

    register()

    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 64, (2, 12))
    attention_mask = torch.ones(2, 12, dtype=torch.long)
    attention_mask[1, :3] = 0  # left padding
    model.config._attn_implementation = "eager"
    eager = model(input_ids=ids, attention_mask=attention_mask).logits
    model.config._attn_implementation = "qkv"
    program = torch.export.export(
        model, (), {"input_ids": ids, "attention_mask": attention_mask, "use_cache": False}
    )
    exported = program.module()(input_ids=ids, attention_mask=attention_mask, use_cache=False)
    real = attention_mask.bool()[:, :, None]
    torch.testing.assert_close(
        exported.logits.masked_fill(~real, 0), eager.masked_fill(~real, 0), atol=1e-4, rtol=1e-4
    )


def test_constant_result_marks_functions_as_torch_does() -> None:
    def probe() -> bool:
        return True

    marked_by_torch = torch.compiler.assume_constant_result(lambda: True)
    marked = {name for name in vars(marked_by_torch) if name.startswith("_dynamo")}
    assert marked and marked <= set(vars(_tracing.constant_result(probe)))


def test_eager_calls_skip_the_operators() -> None:
    """Eagerly, flash runs its functions without the operators' dispatch (decoding pays nothing
    for them): the operator is not called."""
    q, k, v = (x.detach() for x in _inputs())
    calls: list[int] = []
    with pytest.MonkeyPatch.context() as patch:
        from qkv.backends.flash import ops

        patch.setattr(ops, "attention", lambda call: calls.append(1))
        qkv.attention(q, k, v, causal=True, backend="flash")
    assert calls == []
