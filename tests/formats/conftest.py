import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Format tests run many small tensor ops, where a second intra-op thread costs more
    than it saves; restore the setting for the rest of the session."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
