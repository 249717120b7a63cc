"""The MXFP4 quantizer: recipes, numerics, streaming shard writer."""
