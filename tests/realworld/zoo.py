"""Tiny real models built from configs (no downloads), and the faults the suite injects into them.

The models are other people's code: transformers' GPT-2, BERT and T5, timm's ViT and ResNet,
PyTorch's own ``nn.TransformerEncoder`` as its language-modelling tutorial uses it, and a
nanoGPT-style GPT written as nanoGPT writes it. Nothing here imports nanguard.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import math
import sys
import types
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, SEQ = 128, 16


# ------------------------------------------------------------------ faults
class PoisonBackward(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by ``poison`` (a 0-d tensor: 1.0
    is harmless, NaN makes the gradient flowing back through here non-finite). A tensor rather
    than a Python flag, so a compiled graph is not recompiled when the fault is armed."""

    @staticmethod
    def forward(ctx, x, poison):
        ctx.save_for_backward(poison)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        (poison,) = ctx.saved_tensors
        return grad * poison, None


def poison_backward_of(module: nn.Module) -> torch.Tensor:
    """Make the gradient flowing back into ``module``'s output non-finite once the returned
    tensor is set to NaN (``poison.fill_(math.nan)``). The hook is the user's, not nanguard's."""
    poison = torch.ones(())

    def hook(mod, args, output):
        return PoisonBackward.apply(output, poison)

    module.register_forward_hook(hook)
    return poison


def nan_for_batch(model: nn.Module, module: nn.Module) -> dict[str, Any]:
    """A forward fault keyed on the data, as an overflow is: ``module``'s output turns NaN in every
    forward of ``model`` given the token ids held in ``fault["batch"]`` (a re-run of that batch makes
    it again; a flag the script sets per micro-batch would not). The hooks are the user's."""
    fault: dict[str, Any] = {"batch": None, "on": False}

    def given(mod, args, kwargs):
        ids = args[0] if args else kwargs.get("input_ids")
        bad = fault["batch"]
        fault["on"] = bad is not None and isinstance(ids, torch.Tensor) and ids.shape == bad.shape and bool(
            torch.equal(ids, bad))

    model.register_forward_pre_hook(given, with_kwargs=True)
    module.register_forward_hook(lambda mod, args, out: out * math.nan if fault["on"] else None)
    return fault


def set_element(param: torch.Tensor, index: tuple[int, ...], value: float) -> None:
    with torch.no_grad():
        param[index] = value


def token_batch(step: int, batch: int = 4, seq: int = SEQ, vocab: int = VOCAB) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (batch, seq), generator=gen)


# ------------------------------------------------------------------ transformers
def gpt2(**config: Any) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(**{"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": VOCAB,
                                         "n_positions": 32, "bos_token_id": 0, "eos_token_id": 0} | config))


def bert(hidden: int = 64, **config: Any) -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    return BertForMaskedLM(BertConfig(num_hidden_layers=2, hidden_size=hidden, num_attention_heads=4,
                                      intermediate_size=2 * hidden, vocab_size=VOCAB,
                                      max_position_embeddings=32, **config))


def t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    return T5ForConditionalGeneration(T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
        num_heads=4, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))


def llama() -> nn.Module:
    """transformers' Llama: RMSNorm, rotary embeddings handed to the attention by keyword, grouped
    key/value heads, SwiGLU; the layers call their attention as self_attn(hidden_states=...)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, attn_implementation="sdpa"))


def mixtral() -> nn.Module:
    """transformers' Mixtral: a router, then experts that hold their weights as parameters of their
    own (``gate_up_proj``) and apply them in their own forward code before calling ``act_fn``."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=SEQ))


# ------------------------------------------------------------------ timm
class _StandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves an empty ``torchvision`` (and any ``torchvision.*``) whose attributes are
    placeholder classes: timm 1.0 imports torchvision at import time (FrozenBatchNorm2d, dataset
    and transform classes), but the models built here never call it."""

    class Placeholder(type):
        """A class whose every attribute is another placeholder (``InterpolationMode.NEAREST``)."""

        def __getattr__(cls, name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            return _StandIn.Placeholder(name, (), {})

    class Module(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            value = _StandIn.Placeholder(name, (), {"__module__": self.__name__})
            setattr(self, name, value)
            return value

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = self.Module(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def import_timm() -> types.ModuleType:
    """``import timm`` without torchvision installed.

    The torchvision wheel for torch 2.13 does not load on the CPU-only torch ("operator
    torchvision::nms does not exist") and Lightning imports torchvision whenever it is installed,
    so the suite keeps torchvision out: a stand-in exists only while timm is imported and is
    removed from ``sys.modules`` afterwards (Lightning and transformers still see no torchvision).
    """
    if "timm" in sys.modules:
        return sys.modules["timm"]
    if importlib.util.find_spec("torchvision") is not None:
        import timm

        return timm
    finder = _StandIn()
    sys.meta_path.insert(0, finder)
    try:
        import timm
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
    return timm


def vit() -> nn.Module:
    timm = import_timm()
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                             embed_dim=64, num_heads=2, num_classes=10)


def resnet() -> nn.Module:
    """timm's ``test_resnet``: a small ResNet with 15 BatchNorm layers."""
    timm = import_timm()
    torch.manual_seed(0)
    return timm.create_model("test_resnet", pretrained=False, num_classes=10)


def efficientnet() -> nn.Module:
    """timm's ``test_efficientnet``: BatchNormAct2d layers, which run the norm in their own code
    and hand its result to an Identity and an in-place SiLU."""
    timm = import_timm()
    torch.manual_seed(0)
    return timm.create_model("test_efficientnet", pretrained=False, num_classes=10)


def swin() -> nn.Module:
    """timm's Swin with windows of 4 on 32x32 images: its shifted blocks keep an ``attn_mask``
    buffer, which they hand to their attention as an argument."""
    timm = import_timm()
    torch.manual_seed(0)
    return timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=32, window_size=4,
                             embed_dim=32, depths=(2, 2), num_heads=(2, 4), num_classes=10)


def eva() -> nn.Module:
    """timm's EVA-02 (rotary embeddings) on 28x28 images (``image_batch(size=28)``): its attention
    keeps the key's zero bias as a non-persistent buffer, joined into the qkv bias in its own code,
    and runs ``F.scaled_dot_product_attention``."""
    timm = import_timm()
    torch.manual_seed(0)
    return timm.create_model("eva02_tiny_patch14_224", pretrained=False, img_size=28, patch_size=14, embed_dim=32,
                             depth=2, num_heads=2, num_classes=10)


def image_batch(step: int, batch: int = 4, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2000 + step)
    return torch.randn(batch, 3, size, size, generator=gen), torch.randint(0, 10, (batch,), generator=gen)


# ------------------------------------------------------------------ PyTorch's tutorial LM
class TutorialLM(nn.Module):
    """The model of PyTorch's "Language Modeling with nn.Transformer" tutorial: the causal mask
    (``generate_square_subsequent_mask``: 0 and -inf) is made in ``forward`` and passed on."""

    def __init__(self, ntoken: int = VOCAB, d_model: int = 32, nhead: int = 2, nlayers: int = 2):
        super().__init__()
        self.embedding = nn.Embedding(ntoken, d_model)
        layer = nn.TransformerEncoderLayer(d_model, nhead, 64, dropout=0.0, batch_first=True)
        self.transformer_encoder = nn.TransformerEncoder(layer, nlayers, enable_nested_tensor=False)
        self.linear = nn.Linear(d_model, ntoken)

    def forward(self, src: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(src.size(1))
        return self.linear(self.transformer_encoder(self.embedding(src) * math.sqrt(32), mask))


# ------------------------------------------------------------------ nanoGPT, as nanoGPT writes it
class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head = n_head
        causal = torch.tril(torch.ones(block_size, block_size))
        self.register_buffer("bias", causal.view(1, 1, block_size, block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, n_embd: int):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, vocab: int = VOCAB, block_size: int = 32, n_layer: int = 2, n_embd: int = 32,
                 n_head: int = 2):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, n_embd), wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList([Block(n_embd, n_head, block_size) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd)))
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT does

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def nanogpt() -> NanoGPT:
    torch.manual_seed(0)
    return NanoGPT()


# ------------------------------------------------------------------ a policy that returns a distribution
class GaussianHead(nn.Module):
    def __init__(self, width: int, actions: int):
        super().__init__()
        self.mu = nn.Linear(width, actions)
        self.log_std = nn.Parameter(torch.zeros(actions))

    def forward(self, h):
        # validate_args=False, as RL code does for speed: a non-finite scale is not refused here
        return torch.distributions.Normal(self.mu(h), self.log_std.exp(), validate_args=False)


class Actor(nn.Module):
    def __init__(self, obs: int = 4, width: int = 16, actions: int = 2):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(obs, width), nn.Tanh())
        self.head = GaussianHead(width, actions)

    def forward(self, obs):
        return self.head(self.body(obs))
