"""A forked model trains and samples exactly as its own forward says, or the log-prob pass refuses it.

Each edit below is one way a fork changes a tiny Llama / Qwen2 (fp32, CPU): LoRA (peft, or scale.add_lora),
hooks, a swapped activation, a fake-quantised linear, attention dropout, a replaced forward, a sliding window.
The log-prob pass calls the model's decoder and its lm_head, never a second implementation, so for every
one rollout.token_logprobs (each prompt once through the KV cache, share=True, and whole rows, share=False),
its gradients, and the log-probs rollout.sample records equal the plain reference `model(...).logits`. What
only `model(...)` itself would run (a hook on the whole model, an overridden forward, prompt tuning, logit
softcapping or scaling) is refused with a ValueError instead of computed wrongly.

Tolerance: fp32, the same ops up to chunking, the prompt's separate forward and accumulation order: a few eps of
log-probs of ~5 and of gradients, scaled to each tensor's size (conftest.assert_close_scaled: VALUES, GRADS). Every
edit moves the log-probs by more than 1e-2.
"""

import copy
import importlib.util
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import Gemma2Config, Gemma2ForCausalLM, GraniteConfig, GraniteForCausalLM, LlamaForCausalLM

import rollout
from conftest import DECODE, EOS, GRADS, VOCAB, assert_close_scaled, make_tokenizer, tiny
from rollout import left_pad

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft's
# peft is optional: the cases that need it skip before they start, the others run on requirements.txt alone
needs_peft = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="needs peft: pip install peft")
PEFT_EDITS = {"lora", "add_lora", "peft_base"}
V = len(VOCAB)
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
    """The plain reference, the model's own forward: log-probs (N, C) of the last C tokens from its full logits."""
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -C - 1 : -1]  # (N, C, V)
    return logits.float().log_softmax(-1).gather(-1, ids[:, -C:, None]).squeeze(-1)


# -----------------------------------------------------------------------------
# the edits: each takes the model and env (pytest's monkeypatch, defer(undo)) and returns the model to use


def random_lora_b(model):
    """peft starts B at 0, where the adapter adds nothing: random B makes it change the output."""
    g = torch.Generator().manual_seed(7)
    bs = [p for name, p in model.named_parameters() if "lora_B" in name]
    assert len(bs) == len(LINEARS) * 2  # every linear of attention and MLP in both layers, not the head
    for p in bs:
        p.data.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model


def lora(model, env):
    peft = pytest.importorskip("peft", reason="pip install peft")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=LINEARS)
    return random_lora_b(peft.inject_adapter_in_model(cfg, model))


def add_lora(model, env):
    """What --lora-rank does (alpha = 2 rank, all linears)."""
    pytest.importorskip("peft", reason="pip install peft")
    import scale

    return random_lora_b(scale.add_lora(model, 4))


def peft_base(model, env):
    return add_lora(model, env).get_base_model()


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
    def mlps(m, args, out):  # None: output kept
        return 0.5 * out if type(m).__name__.endswith("MLP") else None

    env.defer(nn.modules.module.register_module_forward_hook(mlps).remove)
    return model


def sliding_window(model, env):
    """A Qwen2 built with a window of 4 on its second layer (rows are 10 tokens long), then the config's flag
    turned off: the layer types still say sliding."""
    window = tiny("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1)
    window.load_state_dict(model.state_dict())
    window.config.use_sliding_window = False
    return window.train(model.training)


BOTH = ("llama", "qwen2")
EDITS = {  # name: (edit, model kinds)
    "lora": (lora, BOTH),
    "add_lora": (add_lora, BOTH),
    "peft_base": (peft_base, ("llama",)),
    "layer_hook": (layer_hook, BOTH),
    "mlp_pre_hook": (mlp_pre_hook, BOTH),
    "head_hook": (head_hook, BOTH),
    "gelu_one_layer": (gelu_one_layer, BOTH),
    "gelu_all_layers": (gelu_all_layers, BOTH),
    "fake_quant": (fake_quant, BOTH),
    "attention_dropout": (attention_dropout, BOTH),
    "class_forward": (class_forward, BOTH),
    "instance_forward": (instance_forward, BOTH),
    "global_hook": (global_hook, BOTH),
    "sliding_window": (sliding_window, ("qwen2",)),
}
CASES = [
    pytest.param(name, kind, id=f"{name}-{kind}", marks=[needs_peft] if name in PEFT_EDITS else [])
    for name, (_, kinds) in EDITS.items()
    for kind in kinds
]


@pytest.fixture
def env(monkeypatch):
    undo = []
    yield SimpleNamespace(monkeypatch=monkeypatch, defer=undo.append)
    for f in reversed(undo):
        f()


def edited(name, kind, env):
    """A fresh tiny model of `kind` in train mode (as train.py holds the policy), with the edit applied."""
    return EDITS[name][0](tiny(kind).train(), env)


# -----------------------------------------------------------------------------
# the log-prob pass and sampling follow the edit

# dropout draws its masks per call, and a shared prompt's smaller forward draws other ones than whole rows do:
# the edit with dropout is compared on whole rows only
FORWARD_CASES = [
    pytest.param(name, kind, share, id=f"{name}-{kind}-{share}", marks=[needs_peft] if name in PEFT_EDITS else [])
    for name, (_, kinds) in EDITS.items()
    for kind in kinds
    for share in (True, False)
    if not (share and name == "attention_dropout")
]


@pytest.mark.parametrize("name,kind,share", FORWARD_CASES)
def test_logprobs_and_gradients_equal_the_model_forward(name, kind, share, env):
    """token_logprobs and its gradients equal the edited model's own forward; each edit is the planted change, shown
    to move the log-probs by > 1e-2. Fails if the pass computes anything but the model's own modules (a second
    forward, a cached copy of a weight), which would miss the edit."""
    ids, mask, cmask = rows()
    C, m = cmask.size(1), cmask.bool()
    unedited = forward_logprobs(tiny(kind), ids, mask, C).detach()  # before a class-level edit
    model = edited(name, kind, env)
    if share:  # what train.py asks before it shares prompts
        assert rollout.sharing_problem(model) is None and model.training
    torch.manual_seed(0)  # the same dropout masks in both passes (the edit with dropout): same modules, same order
    logp, ent, kl = rollout.token_logprobs(model, ids, mask, C, share=share)
    torch.manual_seed(0)
    want = forward_logprobs(model, ids, mask, C)
    assert ent is None and kl is None and (logp[~m] == 0).all()
    assert (want[m] - unedited[m]).abs().max() > 1e-2, "the edit must change the log-probs"
    assert_close_scaled(logp[m], want[m])

    names, params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad])
    w = torch.randn(cmask.shape, generator=torch.Generator().manual_seed(2)) * cmask  # (N, C) per-token weights
    got = torch.autograd.grad((w * logp).sum(), params)
    expected = torch.autograd.grad((w * want).sum(), params)
    for n, a, b in zip(names, got, expected):
        assert_close_scaled(a, b, GRADS, msg=n)
        assert "lora_" not in n or b.abs().max() > 1e-3, f"{n}: the adapter must get a gradient"
    assert max(b.abs().max() for b in expected) > 1e-2


@pytest.mark.parametrize("name,kind", CASES)
def test_sample_logp_equals_the_model_forward(name, kind, env):
    """What rollout.sample records while decoding (fp32, temperature 1) is the log-prob the model's own
    forward gives the sampled token. Sampling runs in eval mode: no dropout. Fails if sampling runs weights or
    modules other than the model's own (a copy made before the edit)."""
    model = edited(name, kind, env)
    prompts = ["w1 w2", "w3 w4 w5 w6 w7 w8 w9"]
    r = rollout.sample(
        model,
        make_tokenizer(),
        prompts,
        group_size=2,
        max_new_tokens=8,
        stop_ids=[EOS],
        generator=torch.Generator().manual_seed(0),
    )
    C, m = r.completion_ids.size(1), r.completion_mask.bool()
    assert model.training and m.sum() >= 8
    with torch.no_grad():
        want = forward_logprobs(model.eval(), r.input_ids, r.attention_mask, C)
    # fp32: the cached decode step and the full forward order the same sums differently, ~1e-6 relative
    assert_close_scaled(r.sample_logp[m], want[m], DECODE)


@pytest.mark.parametrize("share", [True, False])
def test_the_lora_reference_is_the_base_with_adapters_off(share):
    """train.py's LoRA reference: the policy under `disable_adapter()` computes the base model's log-probs."""
    pytest.importorskip("peft", reason="pip install peft")
    import scale

    base = tiny("llama")
    policy = random_lora_b(scale.add_lora(copy.deepcopy(base), 4)).train()
    ids, mask, cmask = rows()
    C, m = cmask.size(1), cmask.bool()
    with torch.no_grad():
        want = forward_logprobs(base, ids, mask, C)
        on = rollout.token_logprobs(policy, ids, mask, C, share=share)[0]
        with policy.disable_adapter():
            off = rollout.token_logprobs(policy, ids, mask, C, share=share)[0]
    assert_close_scaled(off[m], want[m])
    assert (on[m] - want[m]).abs().max() > 1e-2, "the adapters must change the log-probs"


@pytest.mark.parametrize("share", [True, False])
@pytest.mark.filterwarnings("ignore:For backward hooks to be called", "ignore:Full backward hook is firing")
def test_a_global_backward_hook_runs(share):
    """It changes gradients only: the log-prob pass runs it, since its modules are called."""
    model = tiny("llama").train()
    ids, mask, cmask = rows()
    C, params = cmask.size(1), list(model.parameters())
    unhooked = torch.autograd.grad(forward_logprobs(model, ids, mask, C)[cmask.bool()].sum(), params)

    def double(m, grad_in, grad_out):
        return tuple(None if g is None else 2 * g for g in grad_in) if type(m).__name__.endswith("MLP") else None

    handle = nn.modules.module.register_module_full_backward_hook(double)
    try:
        got = torch.autograd.grad(rollout.token_logprobs(model, ids, mask, C, share=share)[0].sum(), params)
        want = torch.autograd.grad(forward_logprobs(model, ids, mask, C)[cmask.bool()].sum(), params)
    finally:
        handle.remove()
    for a, b in zip(got, want):
        assert_close_scaled(a, b, GRADS)
    assert max((b - c).abs().max() for b, c in zip(want, unhooked)) > 0.1, "the hook must change gradients"


# -----------------------------------------------------------------------------
# what only model(...) runs is refused


def refused(model, match):
    """Both entry points of the log-prob pass raise a ValueError matching `match`, with either share."""
    ids, mask, cmask = rows()
    for share in (True, False):
        with pytest.raises(ValueError, match=match):
            rollout.token_logprobs(model, ids, mask, cmask.size(1), share=share)
        with pytest.raises(ValueError, match=match):
            rollout.completion_hidden(model, ids, mask, cmask.size(1), share=share)


@pytest.mark.parametrize("pre", [False, True])
def test_a_hook_on_the_whole_model_is_refused(pre):
    """The log-prob pass calls the decoder and the lm_head, not the model's forward: a hook on the model
    itself would run in sampling only."""
    model = tiny("llama")
    if pre:
        model.register_forward_pre_hook(lambda m, args, kwargs: (args, kwargs), with_kwargs=True)
    else:
        model.register_forward_hook(lambda m, args, out: out)
    refused(model, "forward hook on the whole model")


def test_an_overridden_model_forward_is_refused():
    """A subclass whose forward() changes the output would run in sampling only: the log-prob pass raises instead,
    while a subclass that leaves forward alone computes the base's log-probs bit for bit. Fails if the check is
    dropped (doubled logits scored as the head's) or refuses any subclass. Needs no peft (prompt tuning: below)."""

    class Scaled(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2
            return out

    base = tiny("llama")
    model = Scaled(base.config).eval()
    model.load_state_dict(base.state_dict())
    refused(model, "overrides forward")

    class Plain(LlamaForCausalLM):  # a subclass that leaves forward alone is fine
        pass

    plain = Plain(base.config).eval()
    plain.load_state_dict(base.state_dict())
    ids, mask, cmask = rows()
    torch.testing.assert_close(
        rollout.token_logprobs(plain, ids, mask, cmask.size(1))[0],
        rollout.token_logprobs(base, ids, mask, cmask.size(1))[0],
        atol=0,
        rtol=0,
    )


@needs_peft
def test_prompt_tuning_is_refused():
    """PEFT prompt tuning adds virtual tokens in the wrapper's forward, which the log-prob pass never calls: it
    raises instead. Fails if the pass scores the prompts without their virtual tokens."""
    import peft

    tuning = peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2)
    prompt_tuned = peft.get_peft_model(tiny("llama"), tuning)
    refused(prompt_tuned, "virtual tokens")


@pytest.mark.parametrize("kind", ["softcapping", "scaling"])
def test_logit_softcapping_or_scaling_is_refused(kind):
    """Gemma2 soft-caps and Granite scales the logits in the model's forward, after the lm_head: the pass
    would score unscaled logits, so it raises."""
    common = dict(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    model = (
        Gemma2ForCausalLM(Gemma2Config(**common, head_dim=8, final_logit_softcapping=0.5))
        if kind == "softcapping"
        else GraniteForCausalLM(GraniteConfig(**common, logits_scaling=4.0))
    )
    ids, mask, cmask = rows()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        head = model.lm_head(model.get_decoder()(input_ids=ids, attention_mask=mask, position_ids=pos)[0])
    assert (logits - head).abs().max() > 1e-2, "the model's forward must change the head's logits"
    refused(model.eval(), "softcapping/scaling")
