"""The pure-torch reference backend, the oracle every platform's kernels are
checked against (attention.py: gather + scaled_dot_product_attention in
float32; kv_quant.py: the quantized KV rows; validation.py: the contract's
argument checks)."""
