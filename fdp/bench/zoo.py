"""The benchmark models and their synthetic data (shared by ``python -m fdp.bench`` and its
subcommands): an MLP, a small CNN with BatchNorm, ``tiny1000`` (1,000 small layers: 2,000
leaves), a small transformer, ``tiny50`` (50 layers 64 wide: a run of every step kind in
seconds, for the benchmarks' own tests), nanoGPT's GPT (``bench loop``, ``bench sharded``) and a
LLaMA-style decoder (``bench large``)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class MLP(nn.Module):
    """8 x Linear(1024, 1024): 33.6 MB of fp32 parameters, little compute per byte."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(1024, 1024), nn.ReLU())])
        self.head = nn.Linear(1024, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(x))


class Block(nn.Module):
    def __init__(self, c: int, stride: int) -> None:
        super().__init__()
        cin = c // stride if stride > 1 else c
        self.conv1 = nn.Conv2d(cin, c, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)
        self.skip = (nn.Sequential(nn.Conv2d(cin, c, 1, stride, bias=False), nn.BatchNorm2d(c))
                     if stride > 1 else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.skip(x))


class CNN(nn.Module):
    """A small ResNet with BatchNorm (about 2.8M parameters, 26 BN buffers groups)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU())
        self.blocks = nn.Sequential(Block(32, 1), Block(64, 2), Block(128, 2), Block(256, 2))
        self.head = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


class Tiny(nn.Module):
    """1,000 tiny layers (2,000 leaves): the per-leaf overhead of a reducer."""

    def __init__(self, n: int = 1000, width: int = 16) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return x


class Transformer(nn.Module):
    """4 pre-norm transformer encoder blocks, d_model 256, 4 heads, sequence 64."""

    def __init__(self, d: int = 256, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(1000, d)
        block = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, 1000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x)))


class GPTBlock(nn.Module):
    """nanoGPT's block: pre-norm causal self-attention and a 4x MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """nanoGPT's model: token and position embeddings, ``layers`` blocks, a final LayerNorm and
    a head tied to the token embedding; ``nanogpt_init``: nanoGPT's init (normal 0.02, the
    residual projections scaled by 1/sqrt(2 layers)) instead of torch's defaults."""

    def __init__(self, vocab: int, context: int, width: int, layers: int, heads: int,
                 nanogpt_init: bool = True) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(GPTBlock(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.wte.weight
        if nanogpt_init:
            for name, p in self.named_parameters():
                if p.dim() >= 2:
                    std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
                    nn.init.normal_(p, 0.0, std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class Rotary(nn.Module):
    """RoPE's inverse frequencies (a non-persistent buffer, made again by ``reset_parameters``:
    a model built on the meta device gets it from its init)."""

    def __init__(self, head_dim: int, base: float = 10000.0) -> None:
        super().__init__()
        self.head_dim, self.base = head_dim, base
        self.register_buffer("inv_freq", torch.empty(head_dim // 2), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.inv_freq.copy_(1.0 / self.base ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32,
                                                                   device=self.inv_freq.device) / self.head_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (batch, heads, time, head_dim) rotated by position."""
        t = torch.arange(x.shape[-2], device=x.device, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq)
        cos, sin = freqs.cos().to(x.dtype), freqs.sin().to(x.dtype)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class LlamaBlock(nn.Module):
    """A LLaMA decoder layer: RMSNorm, causal attention with RoPE, RMSNorm, a SwiGLU MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(width), nn.RMSNorm(width)
        self.q, self.k, self.v, self.o = (nn.Linear(width, width, bias=False) for _ in range(4))
        hidden = 8 * width // 3
        self.gate, self.up = nn.Linear(width, hidden, bias=False), nn.Linear(width, hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)
        self.rotary = Rotary(width // heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h = self.norm1(x)
        q, k, v = (z(h).view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(self.rotary(q), self.rotary(k), v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, c))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    """A LLaMA-style decoder: a token embedding, ``layers`` decoder layers (each run under
    ``torch.utils.checkpoint`` when ``checkpointing``), a final RMSNorm and a head tied to the
    embedding."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int, checkpointing: bool = False) -> None:
        super().__init__()
        self.checkpointing = checkpointing
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(LlamaBlock(width, heads) for _ in range(layers))
        self.norm = nn.RMSNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointing else block(x)
        return self.head(self.norm(x))


def images(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[torch.Generator], tuple]]] = {
    "mlp": (MLP, lambda g: (torch.randn(64, 1024, generator=g), torch.randint(0, 10, (64,), generator=g))),
    "cnn": (CNN, lambda g: images(32, g)),
    "tiny1000": (Tiny, lambda g: (torch.randn(32, 16, generator=g), torch.randn(32, 16, generator=g))),
    "tiny50": (lambda: Tiny(50, 64), lambda g: (torch.randn(32, 64, generator=g), torch.randn(32, 64, generator=g))),
    "transformer": (Transformer, lambda g: (torch.randint(0, 1000, (8, 64), generator=g),
                                            torch.randint(0, 1000, (8, 64), generator=g))),
}


def loss(name: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if name.startswith("tiny"):
        return F.mse_loss(out, y)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
