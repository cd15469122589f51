"""Tiny model pairs built in seconds, for tests and the ``--quick`` benchmark.

A byte-level BPE tokenizer and a target/draft pair (GPT-2 or Llama architecture) trained
briefly on a synthetic, seeded corpus, so that draft and target agree part of the time the
way a real pair does. Deterministic from the seed; nothing is downloaded.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SUBJECTS = ["the cat", "a dog", "my friend", "the robot", "our teacher", "the river", "a bird"]
VERBS = ["sees", "likes", "follows", "paints", "finds", "builds", "hears"]
OBJECTS = ["the moon", "a red ball", "the old house", "some bread", "the tall tree", "a song"]
ENDINGS = [".", " today.", " again.", " at night.", " in the park."]


def synthetic_corpus(n_sentences: int = 3000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_sentences):
        s = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}{rng.choice(ENDINGS)}"
        if rng.random() < 0.3:
            s += f" def f{rng.randint(0, 9)}(x): return x + {rng.randint(0, 9)}"
        lines.append(s.capitalize())
    return lines


def build_tokenizer(corpus: list[str], vocab_size: int = 320) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    return fast


def make_model(arch: str, vocab_size: int, *, layers: int, hidden: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    if arch == "gpt2":
        cfg = GPT2Config(
            vocab_size=vocab_size, n_positions=512, n_embd=hidden, n_layer=layers, n_head=4,
            bos_token_id=0, eos_token_id=0,
        )
        return GPT2LMHeadModel(cfg)
    if arch == "llama":
        cfg = LlamaConfig(
            vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, bos_token_id=0, eos_token_id=0, tie_word_embeddings=True,
        )
        return LlamaForCausalLM(cfg)
    raise ValueError(f"unknown tiny architecture {arch!r}")


def train(model: torch.nn.Module, ids: torch.Tensor, *, steps: int, seed: int, seq_len: int = 64) -> None:
    """A few hundred steps of next-token training on ``ids`` [n] (fp32, AdamW)."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, ids.numel() - seq_len - 1, (16,), generator=gen)
        batch = torch.stack([ids[s : s + seq_len] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def build_tiny_pair(
    out_dir: str | Path, arch: str = "llama", *, seed: int = 0, steps: int = 150
) -> dict[str, Path]:
    """Write ``{out_dir}/{target,draft}`` (each with the tokenizer); return the two paths.

    The target has 4 layers, the draft 1, both hidden size 64; both are trained on the same
    corpus (the draft for fewer steps) so that they agree often but not always.
    """
    out = Path(out_dir)
    paths = {"target": out / "target", "draft": out / "draft"}
    if all((p / "config.json").exists() for p in paths.values()):
        return paths
    corpus = synthetic_corpus(seed=seed)
    tokenizer = build_tokenizer(corpus)
    ids = torch.tensor(tokenizer("\n".join(corpus) + "<|endoftext|>")["input_ids"], dtype=torch.long)
    vocab = len(tokenizer)
    for name, layers, n_steps in (("target", 4, steps), ("draft", 1, steps // 3)):
        model = make_model(arch, vocab, layers=layers, hidden=64, seed=seed + layers)
        train(model, ids, steps=n_steps, seed=seed)
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.eos_token_id
        model.save_pretrained(paths[name])
        tokenizer.save_pretrained(paths[name])
    return paths
