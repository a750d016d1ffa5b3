"""Cache entry formats: fp8_ds_mla and bf16 main entries; mxfp4, fp8 and bf16 indexer keys."""
