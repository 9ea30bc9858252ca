"""Small models and per-rank synthetic data for the tests, from explicit generators (so a
test's data does not depend on what else drew from the global RNG before it)."""

import threading

import torch
import torch.nn.functional as F
from torch import nn


class FailOnce(torch.autograd.Function):
    """Identity whose backward raises once after ``FailOnce.arm()`` (a bug in one rank's
    backward). Armed per thread: simulated ranks may be threads of one process."""

    state = threading.local()

    @staticmethod
    def arm(on: bool = True) -> None:
        FailOnce.state.armed = on

    @staticmethod
    def forward(x):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        if getattr(FailOnce.state, "armed", False):
            FailOnce.state.armed = False
            raise RuntimeError("injected failure in the backward")
        return g


def init_(module: nn.Module, seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (1.0 / max(1, p.shape[-1]) ** 0.5))
    return module


def mlp(width: int = 16, depth: int = 3, classes: int = 4, seed: int = 0) -> nn.Module:
    layers: list[nn.Module] = []
    d = 8
    for _ in range(depth):
        layers += [nn.Linear(d, width), nn.Tanh()]
        d = width
    layers.append(nn.Linear(d, classes))
    return init_(nn.Sequential(*layers), seed)


class CNN(nn.Module):
    def __init__(self, classes: int = 4):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.fc(x.mean((2, 3)))


def cnn(seed: int = 0) -> nn.Module:
    return init_(CNN(), seed)


def batch(rank: int, step: int = 0, n: int = 6, shape=(8,), classes: int = 4):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn((n, *shape), generator=g), torch.randint(0, classes, (n,), generator=g)


def ce_loss(apply):
    def loss_fn(params, buffers, x, y):
        out, new_buffers = apply(params, buffers, x)
        return F.cross_entropy(out, y), new_buffers

    return loss_fn


class Block(nn.Module):
    """A residual block (LayerNorm, a 2-layer MLP): the unit of fully sharded params."""

    def __init__(self, d: int):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class BlockNet(nn.Module):
    """Token embedding, ``n`` blocks, a final LayerNorm and a head tied to the embedding (as
    GPT-2's): the embedding, the final norm and the head are the root of a fully sharded
    model whose units are the blocks."""

    def __init__(self, vocab: int = 32, d: int = 16, n: int = 3):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(n)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        x = self.emb(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def block_net(seed: int = 0, **kw) -> BlockNet:
    return init_(BlockNet(**kw), seed)


def tokens(rank: int, step: int = 0, n: int = 4, t: int = 5, vocab: int = 32):
    """A batch of token sequences and their next tokens, per rank and step."""
    g = torch.Generator().manual_seed(5000 + 1000 * rank + step)
    seq = torch.randint(0, vocab, (n, t + 1), generator=g)
    return seq[:, :-1], seq[:, 1:]


# Several buckets on these small models.
CAPS = dict(bucket_cap_mb=0.002, first_bucket_cap_mb=0.001)


def loss_of(apply, buffers):
    """The cross-entropy of ``apply``'s output (``buffers`` held fixed): a step's loss."""
    def loss(p, x, y):
        return F.cross_entropy(apply(p, buffers, x)[0], y)
    return loss


def rss_mib() -> float:
    """This process's resident memory (MiB)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # pragma: no cover - not Linux
