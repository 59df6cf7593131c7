"""The Triton kernel tests run on CUDA when there is a GPU, else in Triton's interpreter on CPU tensors.

The interpreter is chosen when Triton is first imported (``TRITON_INTERPRET=1``), so these tests run in
a pytest process of their own: ``tests/test_lora_triton.py`` starts it as part of ``make test``, and
the root ``conftest.py`` keeps the main process from collecting this folder.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def kernel_device() -> torch.device:
    """CPU under Triton's interpreter, else CUDA."""
    import triton

    if triton.knobs.runtime.interpret:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        pytest.fail("no CUDA device and Triton's interpreter is off: run with TRITON_INTERPRET=1")
    return torch.device("cuda")
