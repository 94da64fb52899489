"""Backends: llama.cpp and ONNX Runtime behind the Backend protocol (runtime/backend.py), the
target on RPC servers, and the guards that load untrusted model files in a child first."""
