"""The demo build's sizes (standard library only: the benchmark reads the held-out split's
parameters from here without loading the builder)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BuildConfig:
    # The sizes of the build that made the shipped weights (specdec/demo/weights/metrics.json
    # has its times); `specdec demo-models --train` reruns it.
    seed: int = 0
    target: str | None = None  # a Hugging Face model directory instead of the GGUF (tests)
    head_vocab: int = 8192
    init_layers: tuple = (0, 1)
    topk: int = 32
    # The teacher runs in float32: batched bfloat16 matmuls are ~6x slower on CPUs without
    # bf16 instructions (prefill 77 vs 488 tokens/s here), and greedy answers barely differ.
    teacher_dtype: str = "float32"
    # chat data: the target's own greedy answers (the draft's and the EAGLE head's main diet)
    n_chat_train: int = 960
    n_chat_heldout: int = 16
    max_new_tokens: int = 160
    gen_batch: int = 64
    # code data: the target's continuations of training-file heads (what the benchmark's code
    # workload asks of it), and its log-probs on stdlib chunks
    n_code_heads: int = 192
    code_head_tokens: int = 128
    code_head_new_tokens: int = 128
    code_chunk: int = 256
    n_code_chunks: int = 240
    n_code_eval_chunks: int = 12
    heldout_file_frac: float = 0.08
    # training (the draft and the EAGLE head train side by side, one core each, ~30 minutes)
    steps: int = 280
    batch_tokens: int = 4096
    lr: float = 1e-3
    head_lr: float = 1e-3
    warmup: int = 10
    weight_decay: float = 0.0
    budget_s: float | None = None
    threads: int | None = None  # torch threads for the build (None: torch's default)
    # the EAGLE head (phase 7): one layer on the target's features, the draft's vocabulary
    eagle_steps: int = 720
    eagle_lr: float = 2e-3
    eagle_intermediate_size: int | None = 1024  # the head layer's MLP (the target's: 1536); keeps the draft and this head under 30 MB
    # the Medusa heads (phase 8): ResBlock heads on the target's features, the same vocabulary
    medusa_heads: int = 4
    medusa_layers: int = 1
    medusa_steps: int = 400
    medusa_lr: float = 2e-3
    medusa_batch_rows: int = 512
    # EAGLE-3's training-time test: unroll the head this many steps on its own predictions
    eagle_ttt_steps: int = 3
    # diverse teacher prompts for the EAGLE head (diverse_prompts.py, eagle_data.py): answers
    # generated in diverse_gen_dtype, labels and features recomputed in float32
    n_diverse: int = 256
    n_self_instruct: int = 64
    self_instruct_tokens: int = 40
    diverse_new_tokens: int = 64
    diverse_gen_dtype: str = "bfloat16"
    n_docstring_answers: int = 320  # stdlib docstrings as answers (no generation)
    exit_layers: tuple = ()  # early-exit adapters after these layers (`--early-exit` adds layer 8)
    log: list = field(default_factory=list)
