from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread() -> Iterator[None]:
    # On a 2-core machine shared with other work, torch's second intra-op thread is often
    # descheduled and every parallel op waits for it (~8 ms each); one thread is 10x faster here.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
