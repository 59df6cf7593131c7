"""Weight-only matmuls on GGUF block-quantized weights (``Q4_0``, ``Q4_1``, ``Q8_0``): ``formats`` restates
the block layouts (dequantization in torch), ``block_weight.BlockWeight`` is a base weight kept in its blocks
and multiplied by the C++ kernel (``block_gemm.cpp``, AVX2 and AVX-512 builds chosen at run time)."""
