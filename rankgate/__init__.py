"""Rankgate: an OpenAI-compatible gateway in front of vLLM that routes every request to the
data-parallel rank that serves it fastest.

The repository keeps one folder per part (``app``, ``sidecar``, ``multimodal``, ``mocker``);
installed, they are the subpackages of this one namespace, so nothing generic lands in
site-packages.
"""

__version__ = "0.1.0"
