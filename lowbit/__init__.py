"""lowbit: run Mixture-of-Experts LLMs quantized to 3-8 bits, in pure Python on PyTorch + Triton."""

from lowbit.engine.llm import LLM, CompletionOutput, RequestOutput
from lowbit.engine.sampling import SamplingParams
from lowbit.errors import LowbitError

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "LowbitError", "__version__"]
