"""Triton kernels for CUDA GPUs, each beside its torch reference.

Importing this package (or any module in it) never imports a GPU runtime eagerly and never
fails without triton: kernels are built when first launched, on CUDA tensors or on CPU
tensors under Triton's interpreter (`TRITON_INTERPRET=1`, how the tests run them).
"""
