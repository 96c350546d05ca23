"""Run the Triton kernels on the CPU through triton's interpreter.

TRITON_INTERPRET is read when triton is first imported, so it is set here, before any test
module (or engine.kernels.*) imports triton.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

from collections.abc import Iterator  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread() -> Iterator[None]:
    # The interpreter runs every program step as small torch ops; on the 2-core dev machine a
    # second intra-op thread only adds scheduling stalls.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
