"""pagellm: a PagedAttention LLM inference engine in device-agnostic PyTorch."""
from pagellm.entrypoints.beam_search import BeamSearchParams
from pagellm.entrypoints.llm import LLM
from pagellm.outputs import CompletionOutput, Logprob, RequestOutput
from pagellm.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]
