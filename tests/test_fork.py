"""A forked model trains and samples exactly as its own forward says, or lean says why it is off.

Each edit below is one way a fork changes a tiny Llama / Qwen2 (fp32, CPU): LoRA, hooks, a swapped
activation, a fake-quantised linear, attention dropout, a replaced forward, a sliding window. For every
one, rollout.py's plain path (log-probs, their gradients, the log-probs recorded while sampling) equals
the model's own forward, and lean.check refuses the model with a reason that names the edit. That lean
and the plain path agree on unmodified models is in test_lean.py.
"""

import re
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import lean
import rollout
from conftest import EOS, VOCAB, make_tokenizer, tiny
from rollout import left_pad

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft's
V, CPU = len(VOCAB), torch.device("cpu")
LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def rows(G=2, C=6, seed=1):
    """Two left-padded prompts (7 and 3 tokens), each G times, then C completion tokens; row 0 stops
    after 3: ids, mask (N, P+C), completion mask (N, C). 10 tokens a row: more than a window of 4."""
    g = torch.Generator().manual_seed(seed)
    prompts, pmask = left_pad([torch.randint(5, V, (n,), generator=g).tolist() for n in (7, 3)], pad_id=0)
    prompts, pmask = prompts.repeat_interleave(G, 0), pmask.repeat_interleave(G, 0)  # (N, P)
    cmask = torch.ones(prompts.size(0), C, dtype=torch.long)
    cmask[0, 3:] = 0
    comp = torch.randint(5, V, cmask.shape, generator=g).masked_fill(cmask == 0, 0)  # (N, C)
    return torch.cat([prompts, comp], 1), torch.cat([pmask, cmask], 1), cmask


def forward_logprobs(model, ids, mask, C):
    """The model's own forward: log-probs (N, C) of the last C tokens from its full logits."""
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -C - 1:-1]  # (N, C, V)
    return logits.float().log_softmax(-1).gather(-1, ids[:, -C:, None]).squeeze(-1)


# -----------------------------------------------------------------------------
# the edits: each takes the model and env (pytest's monkeypatch, defer(undo)) and returns the model to use

def lora_config():
    from peft import LoraConfig
    return LoraConfig(r=4, lora_alpha=8, target_modules=LINEARS)


def random_lora_b(model):
    """peft starts B at 0, where the adapter adds nothing: random B makes it change the output."""
    g = torch.Generator().manual_seed(7)
    bs = [p for name, p in model.named_parameters() if "lora_B" in name]
    assert len(bs) == len(LINEARS) * 2  # every linear of both layers
    for p in bs:
        p.data.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model


def lora(model, env):
    peft = pytest.importorskip("peft", reason="pip install peft")
    return random_lora_b(peft.inject_adapter_in_model(lora_config(), model))


def peft_model(model, env):
    peft = pytest.importorskip("peft", reason="pip install peft")
    return random_lora_b(peft.get_peft_model(model, lora_config()))


def peft_base(model, env):
    return peft_model(model, env).get_base_model()


def layer_hook(model, env):
    model.model.layers[0].register_forward_hook(lambda m, args, out: out * 1.5)
    return model


def mlp_pre_hook(model, env):
    model.model.layers[1].mlp.register_forward_pre_hook(lambda m, args: (args[0] * 0.5,))
    return model


def head_hook(model, env):
    bias = torch.randn(V, generator=torch.Generator().manual_seed(3))
    model.lm_head.register_forward_hook(lambda m, args, out: out + bias)
    return model


def gelu_one_layer(model, env):
    model.model.layers[0].mlp.act_fn = nn.GELU()
    return model


def gelu_all_layers(model, env):
    for layer in model.model.layers:
        layer.mlp.act_fn = nn.GELU()
    return model


class FakeQuantLinear(nn.Linear):
    """Quantisation-aware training: the weight rounded to a grid of 0.05 in forward, straight-through gradient."""

    def forward(self, x):
        w = self.weight + (torch.round(self.weight / 0.05) * 0.05 - self.weight).detach()
        return F.linear(x, w, self.bias)


def fake_quant(model, env):
    attn = model.model.layers[0].self_attn
    quant = FakeQuantLinear(attn.v_proj.in_features, attn.v_proj.out_features, bias=attn.v_proj.bias is not None)
    quant.load_state_dict(attn.v_proj.state_dict())
    attn.v_proj = quant
    return model


def attention_dropout(model, env):
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    return model.train()


def class_forward(model, env):
    cls = type(model.model.layers[0].mlp)
    original = cls.forward
    env.monkeypatch.setattr(cls, "forward", lambda self, x: 0.5 * original(self, x))  # undone after the test
    return model


def instance_forward(model, env):
    mlp = model.model.layers[1].mlp
    original = mlp.forward
    mlp.forward = lambda x: 0.5 * original(x)
    return model


def global_hook(model, env):
    mlps = lambda m, args, out: 0.5 * out if type(m).__name__.endswith("MLP") else None  # None: output kept
    env.defer(nn.modules.module.register_module_forward_hook(mlps).remove)
    return model


def sliding_window(model, env):
    """A Qwen2 built with a window of 4 on its second layer, then the config's flag turned off."""
    window = tiny("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1)
    window.load_state_dict(model.state_dict())
    window.config.use_sliding_window = False
    return window.train(model.training)


BOTH = ("llama", "qwen2")
EDITS = {  # name: (edit, what lean.check's reason says, model kinds)
    "lora": (lora, r"lora", BOTH),
    "peft_model": (peft_model, r"PeftModel", ("llama",)),
    "peft_base": (peft_base, r"lora", ("llama",)),
    "layer_hook": (layer_hook, r"layers\.0 has a hook", BOTH),
    "mlp_pre_hook": (mlp_pre_hook, r"layers\.1\.mlp has a hook", BOTH),
    "head_hook": (head_hook, r"lm_head has a hook", BOTH),
    "gelu_one_layer": (gelu_one_layer, r"layers\.0\.mlp\.act_fn is a .*GELU", BOTH),
    "gelu_all_layers": (gelu_all_layers, r"act_fn is a .*GELU", BOTH),
    "fake_quant": (fake_quant, r"v_proj is a .*FakeQuantLinear", BOTH),
    "attention_dropout": (attention_dropout, r"attention dropout 0.5 in train mode", BOTH),
    "class_forward": (class_forward, r"mlp: forward replaced", BOTH),
    "instance_forward": (instance_forward, r"layers\.1\.mlp: forward replaced", BOTH),
    "global_hook": (global_hook, r"global module hook", BOTH),
    "sliding_window": (sliding_window, r"sliding", ("qwen2",)),
}
CASES = [pytest.param(name, kind, id=f"{name}-{kind}") for name, (_, _, kinds) in EDITS.items() for kind in kinds]


@pytest.fixture
def env(monkeypatch):
    undo = []
    yield SimpleNamespace(monkeypatch=monkeypatch, defer=undo.append)
    for f in reversed(undo):
        f()


def edited(name, kind, env):
    """A fresh tiny model of `kind` in train mode (as train.py holds the policy), with the edit applied."""
    model = tiny(kind).train()
    assert lean.check(model)[0], "the model before the edit must pass"
    return EDITS[name][0](model, env)


# -----------------------------------------------------------------------------
# the plain path follows the edit

@pytest.mark.parametrize("name,kind", CASES)
def test_plain_logprobs_and_gradients_equal_the_model_forward(name, kind, env):
    ids, mask, cmask = rows()
    C, m = cmask.size(1), cmask.bool()
    unedited = forward_logprobs(tiny(kind), ids, mask, C).detach()  # before a class-level edit
    model = edited(name, kind, env)
    torch.manual_seed(0)  # the same dropout masks in both passes (the edit with dropout): same modules, same order
    logp, ent, kl = rollout.token_logprobs(model, ids, mask, C)
    torch.manual_seed(0)
    want = forward_logprobs(model, ids, mask, C)
    assert ent is None and kl is None and (logp[~m] == 0).all()
    assert (want[m] - unedited[m]).abs().max() > 1e-2, "the edit must change the log-probs"
    # fp32, the same ops up to chunking and accumulation order: ~1e-6 relative on log-probs of ~5
    torch.testing.assert_close(logp[m], want[m], atol=1e-5, rtol=0)

    names, params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad])
    w = torch.randn(cmask.shape, generator=torch.Generator().manual_seed(2)) * cmask  # (N, C) per-token weights
    got = torch.autograd.grad((w * logp).sum(), params)
    expected = torch.autograd.grad((w * want).sum(), params)
    for n, a, b in zip(names, got, expected):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=n)  # as above: fp32, another order
        assert "lora_" not in n or b.abs().max() > 1e-3, f"{n}: the adapter must get a gradient"
    assert max(b.abs().max() for b in expected) > 1e-2


@pytest.mark.parametrize("name,kind", CASES)
def test_sample_logp_equals_the_model_forward(name, kind, env):
    """What rollout.sample records while decoding (fp32, temperature 1) is the log-prob the model's own
    forward gives the sampled token. Sampling runs in eval mode: no dropout."""
    model = edited(name, kind, env)
    prompts = ["w1 w2", "w3 w4 w5 w6 w7 w8 w9"]
    r = rollout.sample(model, make_tokenizer(), prompts, group_size=2, max_new_tokens=8, stop_ids=[EOS],
                       generator=torch.Generator().manual_seed(0))
    C, m = r.completion_ids.size(1), r.completion_mask.bool()
    assert model.training and m.sum() >= 8
    with torch.no_grad():
        want = forward_logprobs(model.eval(), r.input_ids, r.attention_mask, C)
    # fp32: the cached decode step and the full forward order the same sums differently, ~1e-6 relative
    torch.testing.assert_close(r.sample_logp[m], want[m], atol=1e-5, rtol=0)


# -----------------------------------------------------------------------------
# lean refuses it, and says why

@pytest.mark.parametrize("name,kind", CASES)
def test_lean_refuses_the_edit_and_names_it(name, kind, env):
    model = edited(name, kind, env)
    ok, why = lean.check(model)
    assert not ok and re.search(EDITS[name][1], why, re.IGNORECASE), why
    ids, mask, cmask = rows()
    C, P = cmask.size(1), ids.size(1) - cmask.size(1)
    refused = pytest.raises(ValueError, match=re.escape(f"lean cannot reproduce this model ({why})"))
    with refused:
        lean.token_logprobs(model, ids, mask, C)
    with refused:
        lean.completion_hidden(model, ids, mask, C)
    with refused:
        lean.LeanDecoder(model, ids[::2, :P], mask[::2, :P], 2, 4)
    with pytest.raises(ValueError, match=re.escape(why)):
        lean.select("on", model, CPU)
    assert lean.select("auto", model, CPU) == (False, f"lean: off ({why})")
    assert lean.select("off", model, CPU) == (False, "lean: off (--lean off)")


def test_an_unmodified_model_passes_the_check():
    """The other half: Llama / Qwen2 as the library defines them pass, in train and eval mode, and
    lean is then on for --lean auto on CPU. That lean then computes what the plain path computes is
    test_lean.py's: test_token_logprobs_and_gradients_equal_the_plain_path_fp32 (log-probs, entropy,
    gradients), test_lean_step_equals_the_hf_forward_fp32 (decoder logits)."""
    for kind in ("llama", "qwen2", "llama_bias"):
        model = tiny(kind)
        for training in (True, False):
            assert lean.check(model.train(training)) == (True, "Llama / Qwen2 modules as the library defines them")
        assert lean.select("auto", model, CPU) == lean.select("on", model, CPU) == (True, "lean: on")
        on, line = lean.select("auto", model, torch.device("cuda"))  # measured on CPU only
        assert not on and line.startswith("lean: off (auto uses it on CPU")
        assert lean.select("on", model, torch.device("cuda")) == (True, "lean: on")


def test_gradient_checkpointing_is_not_an_edit():
    """HF's gradient checkpointing hooks the input embeddings (it marks their output as needing grad);
    lean calls that module itself, so the check lets this one hook through, and lean still equals the
    plain path. Any other hook there is refused."""
    model = tiny("llama").train()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    assert model.model.embed_tokens._forward_hooks, "transformers no longer hooks the embeddings: drop the exception"
    assert lean.check(model)[0]
    ids, mask, cmask = rows()
    C, params = cmask.size(1), list(model.parameters())
    (logp, _, _), (want, _, _) = (f(model, ids, mask, C, group_size=2) for f in (lean.token_logprobs,
                                                                                 rollout.token_logprobs))
    torch.testing.assert_close(logp, want, atol=1e-5, rtol=0)  # fp32, another order: ~1e-6 relative
    for a, b in zip(torch.autograd.grad(logp.sum(), params), torch.autograd.grad(want.sum(), params)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    model.model.embed_tokens.register_forward_hook(lambda m, args, out: out)
    assert lean.check(model) == (False, "model.embed_tokens has a hook")


@pytest.mark.filterwarnings("ignore:For backward hooks to be called", "ignore:Full backward hook is firing")
def test_a_global_backward_hook_is_refused():
    """It changes gradients only: the plain path runs it (its modules are called), lean's Functions would not."""
    model = tiny("llama").train()
    ids, mask, cmask = rows()
    C, params = cmask.size(1), list(model.parameters())
    unhooked = torch.autograd.grad(forward_logprobs(model, ids, mask, C)[cmask.bool()].sum(), params)
    double = lambda m, grad_in, grad_out: tuple(None if g is None else 2 * g for g in grad_in) \
        if type(m).__name__.endswith("MLP") else None
    handle = nn.modules.module.register_module_full_backward_hook(double)
    try:
        assert lean.check(model) == (False, "a global module hook is registered")
        got = torch.autograd.grad(rollout.token_logprobs(model, ids, mask, C)[0].sum(), params)
        want = torch.autograd.grad(forward_logprobs(model, ids, mask, C)[cmask.bool()].sum(), params)
    finally:
        handle.remove()
    for a, b, c in zip(got, want, unhooked):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)  # fp32, another order: ~1e-6 relative
    assert max((b - c).abs().max() for b, c in zip(want, unhooked)) > 0.1, "the hook must change gradients"


@pytest.mark.parametrize("pre", [False, True])
def test_a_hook_on_the_whole_model_is_refused_by_both_paths(pre):
    """The log-prob pass calls the decoder and the lm_head, not the model's forward: a hook on the model
    itself would run in sampling only, so the plain path raises instead of skipping it."""
    model = tiny("llama")
    if pre:
        model.register_forward_pre_hook(lambda m, args, kwargs: (args, kwargs), with_kwargs=True)
    else:
        model.register_forward_hook(lambda m, args, out: out)
    assert lean.check(model) == (False, "LlamaForCausalLM has a hook")
    ids, mask, cmask = rows()
    with pytest.raises(ValueError, match="forward hook on the whole model"):
        rollout.token_logprobs(model, ids, mask, cmask.size(1))


def test_an_overridden_model_forward_or_prompt_tuning_is_refused_by_the_plain_path():
    """A subclass whose forward() changes the output, or PEFT prompt tuning (virtual tokens added in the
    wrapper's forward), would run in sampling only: the log-prob pass raises instead."""
    from transformers import LlamaForCausalLM

    class Scaled(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2
            return out

    base = tiny("llama")
    model = Scaled(base.config).eval()
    model.load_state_dict(base.state_dict())
    ids, mask, cmask = rows()
    with pytest.raises(ValueError, match="overrides forward"):
        rollout.token_logprobs(model, ids, mask, cmask.size(1))

    class Plain(LlamaForCausalLM):  # a subclass that leaves forward alone is fine
        pass
    plain = Plain(base.config).eval()
    plain.load_state_dict(base.state_dict())
    torch.testing.assert_close(rollout.token_logprobs(plain, ids, mask, cmask.size(1))[0],
                               rollout.token_logprobs(base, ids, mask, cmask.size(1))[0], atol=0, rtol=0)
    peft = pytest.importorskip("peft", reason="pip install peft")
    prompt_tuned = peft.get_peft_model(tiny("llama"), peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2))
    with pytest.raises(ValueError, match="virtual tokens"):
        rollout.token_logprobs(prompt_tuned, ids, mask, cmask.size(1))


def test_sliding_window_left_on_the_modules_is_refused():
    """The config's flag and layer types both say full attention; an attention module still has its window."""
    model = sliding_window(tiny("qwen2"), None)
    model.config.layer_types = ["full_attention"] * model.config.num_hidden_layers
    assert model.model.layers[1].self_attn.sliding_window == 4
    assert lean.check(model) == (False, "model.layers.1.self_attn uses sliding-window attention")


def test_removing_a_hook_makes_the_model_pass_again():
    """The check looks at the model as it is now, not at what was once done to it."""
    model = tiny("llama")
    handle = model.lm_head.register_forward_hook(lambda m, args, out: out)
    assert lean.check(model) == (False, "lm_head has a hook")
    handle.remove()
    assert lean.check(model)[0]
    handle = nn.modules.module.register_module_forward_pre_hook(lambda m, args: None)
    try:
        assert lean.check(model) == (False, "a global module hook is registered")
    finally:
        handle.remove()
    assert lean.check(model)[0]
