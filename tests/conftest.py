import pytest
import torch

from specdec.bench.tiny import build_tiny_pair

# Tiny models run fastest on one thread, and Ray workers in the same tests need the other core.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def llama_pair(tmp_path_factory):
    return build_tiny_pair(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def gpt2_pair(tmp_path_factory):
    return build_tiny_pair(tmp_path_factory.mktemp("tiny_gpt2"), "gpt2")
