"""Tiny Hugging Face ``transformers`` models (configs only, no download) and their data, for
the tests that run fdp on models nobody here wrote."""

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers.models.gpt2.modeling_gpt2 import GPT2Block
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

VOCAB = 64


def gpt2(seed: int = 0) -> tuple[GPT2LMHeadModel, type]:
    """GPT-2 with 2 blocks of width 16, its head tied to the token embedding; no dropout."""
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, use_cache=False)
    return GPT2LMHeadModel(config), GPT2Block


def llama(seed: int = 0, tied: bool = False) -> tuple[LlamaForCausalLM, type]:
    """LLaMA (RMSNorm, RoPE, SwiGLU, grouped-query attention) with 2 layers of width 16."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
                         tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0, use_cache=False)
    return LlamaForCausalLM(config), LlamaDecoderLayer


MODELS = {"gpt2": gpt2, "llama": llama, "llama-tied": lambda seed=0: llama(seed, tied=True)}


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and their next tokens, per rank and step."""
    g = torch.Generator().manual_seed(100 * rank + step)
    ids = torch.randint(0, VOCAB, (2, 9), generator=g)
    return ids[:, :-1], ids[:, 1:]


def lm_loss(apply, buffers):
    """The causal LM loss of an HF model through fdp's ``apply`` (logits from ``out.logits``)."""
    def loss(params, x, y):
        out, _ = apply(params, buffers, input_ids=x)
        return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())
    return loss
