"""mempath: an LLM inference engine that plans, places, moves and reports every
consumer of GPU memory together."""
from mempath.config import EngineConfig
from mempath.constants import VERSION
from mempath.outputs import RequestOutput
from mempath.llm import LLM
from mempath.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput"]
__version__ = VERSION
