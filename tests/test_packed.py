"""Linear layers on prepacked weights (``specdec.models.packed``): the same products as
``F.linear`` (to the dtype's rounding: another kernel), a weight written after packing is
repacked, autograd and ``stock()`` take ``F.linear``, and ``load_model`` packs what it serves."""

import pytest
import torch
import torch.nn.functional as F

from specdec.models import packed


def _layer(dtype, bias=True):
    torch.manual_seed(0)
    layer = torch.nn.Linear(96, 40, bias=bias).to(dtype)
    if not packed.available(dtype):
        pytest.skip(f"no packed {dtype} products on this machine")
    assert packed.pack_linears(layer) == 1 and isinstance(layer, packed.PackedLinear)
    return layer


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("shape", [(1, 96), (7, 96), (1, 3, 96)])
def test_packed_products_equal_f_linear(dtype, tol, shape):
    layer = _layer(dtype)
    x = torch.randn(*shape).to(dtype)
    with torch.inference_mode():
        got, want = layer(x), F.linear(x, layer.weight, layer.bias)
    assert got.shape == want.shape and got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_a_weight_written_after_packing_is_repacked():
    layer = _layer(torch.float32)
    x = torch.randn(4, 96)
    with torch.no_grad():
        before = layer(x)
        layer.weight.mul_(2)
        after = layer(x)
    torch.testing.assert_close(after - layer.bias, 2 * (before - layer.bias), rtol=1e-5, atol=1e-5)


def test_autograd_and_stock_take_f_linear(monkeypatch):
    layer = _layer(torch.float32, bias=False)
    x = torch.randn(3, 96)
    layer(x).sum().backward()  # a gradient reaches the weight: F.linear's path
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0
    layer.weight.requires_grad_(False)  # frozen, under a loss of what feeds it: the input's gradient
    h = x.clone().requires_grad_(True)
    layer(h).sum().backward()
    torch.testing.assert_close(h.grad, layer.weight.sum(0).expand_as(h))
    calls = []
    monkeypatch.setattr(packed, "linear", lambda *a: calls.append(1) or F.linear(a[0], layer.weight))
    with torch.no_grad():
        layer(x)
        assert len(calls) == 1
        with packed.stock():
            want = layer(x)
        assert len(calls) == 1  # the stock block never called the packed product
    assert torch.equal(want, F.linear(x, layer.weight))


def test_load_model_serves_packed_layers(llama_pair):
    from specdec.loading import load_model

    model = load_model(str(llama_pair["target"]), "float32")
    kinds = {type(m).__name__ for m in model.modules() if isinstance(m, torch.nn.Linear)}
    assert kinds == ({"PackedLinear"} if packed.available(torch.float32) else {"Linear"})



def test_half_weights_are_the_models_weights_rounded_to_fp16(llama_pair):
    """``dtype: float16-weights``: every linear layer's weight is rounded to fp16 in place (a tied
    embedding reads the rounded values too) and its products equal ``F.linear`` on those weights
    to fp32 rounding, at one and many rows; ``dtype_name`` says which format was served; a copy
    repacks on half weights."""
    import copy

    from specdec.loading import dtype_name, load_model

    if not packed.half_available():
        pytest.skip("no FBGEMM fp16 products on this machine")
    exact = load_model(str(llama_pair["target"]), "float32")
    model = load_model(str(llama_pair["target"]), "float16-weights")
    assert dtype_name(model) == "float16-weights" and dtype_name(exact) == "float32"
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert layers and all(isinstance(m, packed.PackedLinear) and m.half for m in layers)
    originals = dict(exact.named_parameters())
    for name, p in model.named_parameters():
        if name.endswith(".weight") and p.dim() == 2 and name in originals:
            assert torch.equal(p, originals[name].half().float()), name
    if model.config.tie_word_embeddings:
        assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    for layer in (layers[0], layers[-1], copy.deepcopy(layers[-1])):
        for rows in (1, 5, 33):
            x = torch.randn(rows, layer.in_features)
            with torch.inference_mode():
                got = layer(x)
            torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="CPU format"):
        load_model(str(llama_pair["target"]), "float16-weights", device="cuda")

@pytest.mark.parametrize("half", [False, True])
def test_packed_rows_are_the_matmul_and_repack_when_the_weight_changes(half):
    """``PackedRows`` (a head's rows of the target's LM head): ``x @ w.T`` on the packed weight,
    to fp32 rounding; packed again when the weight is written or another is passed; the matmul
    where autograd records (a head in training), and in a copy, which repacks."""
    import copy

    if not (packed.half_available() if half else packed.available(torch.float32)):
        pytest.skip("no such packed products on this machine")
    w = torch.randn(300, 64)
    w = w.half().float() if half else w
    rows, x = packed.PackedRows(half), torch.randn(1, 5, 64)
    with torch.inference_mode():
        torch.testing.assert_close(rows(x, w), x @ w.T, rtol=1e-5, atol=1e-5)
        first = rows._packed
        assert first is not None
        w.mul_(2)
        torch.testing.assert_close(rows(x, w), x @ w.T, rtol=1e-5, atol=1e-5)
        other = torch.randn(7, 64).half().float()
        torch.testing.assert_close(rows(x, other), x @ other.T, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(copy.deepcopy(rows)(x, w), x @ w.T, rtol=1e-5, atol=1e-5)
    x.requires_grad_(True)
    rows(x, w).sum().backward()
    torch.testing.assert_close(x.grad, w.sum(0).expand(1, 5, 64))


def test_a_copy_repacks():
    import copy
    import pickle

    layer = _layer(torch.float32)
    x = torch.randn(2, 96)
    with torch.no_grad():
        want = layer(x)
        for other in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
            assert isinstance(other, packed.PackedLinear) and torch.equal(other(x), want)


def test_a_layer_made_under_inference_mode_packs():
    if not packed.available(torch.float32):
        pytest.skip("no packed fp32 products on this machine")
    with torch.inference_mode():
        layer = torch.nn.Linear(96, 40)
        assert packed.pack_linears(layer) == 1
        x = torch.randn(3, 96)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def _llama(dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    if not packed.available(dtype):
        pytest.skip(f"no packed {dtype} products on this machine")
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=120)
    return LlamaForCausalLM(cfg).to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_siblings_give_each_layer_its_own_product_bit_for_bit(dtype, monkeypatch):
    """q / k / v and gate / up run as one product a group, and each part is what the layer's
    own packed product gives; a whole forward makes 4 products a layer instead of 7."""
    model = _llama(dtype)
    x = torch.randn(5, 96).to(dtype)
    with torch.inference_mode():
        separate = {}
        for name, m in model.named_modules():
            if type(m) is torch.nn.Linear and name.split(".")[-1] in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
                separate[name] = packed.linear(x, packed.pack(m.weight), m.bias)
        ids = torch.randint(0, 120, (1, 7))
        assert packed.pack_linears(model) == 2 * 7 + 1
        layers = dict(model.named_modules())
        assert all(layers[n].siblings is not None for n in separate)
        for name, want in separate.items():  # in the layer's calling order, and each alone
            assert torch.equal(layers[name](x), want), name
        unfused = _llama(dtype)
        for m in unfused.modules():
            if type(m) is torch.nn.Linear:
                m.__class__ = packed.PackedLinear
                m._repack()
        products = []
        real = packed.linear
        monkeypatch.setattr(packed, "linear", lambda *a: products.append(1) or real(*a))
        got = model(ids).logits
        assert len(products) == 2 * 4 + 1  # qkv, o, gate-up, down a layer; the LM head
        assert torch.equal(got, unfused(ids).logits)


def test_a_sibling_called_out_of_order_or_on_another_input_is_still_its_own_product():
    model = _llama(torch.float32)
    packed.pack_linears(model)
    attn = model.model.layers[0].self_attn
    x, y = torch.randn(3, 96), torch.randn(3, 96)
    want = {n: F.linear(x, getattr(attn, n).weight) for n in ("q_proj", "k_proj", "v_proj")}
    fused = attn.q_proj.siblings

    def close(a, b):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

    with torch.inference_mode():
        for window in (False, True):  # outside the attention's forward, and inside it
            if window:
                fused.open()
            for order in (("v_proj", "q_proj", "k_proj"), ("k_proj", "k_proj", "q_proj")):
                for n in order:
                    close(getattr(attn, n)(x), want[n])
        attn.q_proj(x)  # k's part of x pending, then k asked for y: y's product
        close(attn.k_proj(y), F.linear(y, attn.k_proj.weight))
        attn.q_proj(x)
        fused.close()  # the forward ended: nothing pending is used after it
        z = x.clone().mul_(2)
        close(attn.k_proj(z), F.linear(z, attn.k_proj.weight))
        assert fused._local.held is None
    with torch.no_grad():
        attn.k_proj.weight.mul_(2)  # a member's weight written: the stacked weight repacks
        close(attn.k_proj(x), 2 * want["k_proj"])
    model(torch.randint(0, 120, (1, 5)))  # a forward leaves nothing held
    assert fused._local.held is None and not fused._local.open

    def fail(*_):
        raise RuntimeError("a failing step")

    attn.o_proj.register_forward_pre_hook(fail)  # after q / k / v: a forward that raises midway
    with torch.inference_mode(), pytest.raises(RuntimeError, match="a failing step"):
        model(torch.randint(0, 120, (1, 5)))
    assert fused._local.held is None and not fused._local.open  # nothing of it is kept either
