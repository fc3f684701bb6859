"""Example LightningModules written the ordinary single-device way; they know nothing about parallelism."""

from examples.models.encoder import EncoderClassifier
from examples.models.gpt import GPT
from examples.models.llama import Llama
from examples.models.mixtral import Mixtral

__all__ = ["GPT", "EncoderClassifier", "Llama", "Mixtral"]
