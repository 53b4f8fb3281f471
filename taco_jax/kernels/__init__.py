"""The codec kernels: fused GPU kernels beside their plain-jnp references.

`dispatch` chooses per call how a kernel runs (a GPU kernel or the reference), asking the
codec family's provider (`providers`) which kernels it has. `references` holds the jnp
references; `triton` the Pallas-Triton kernels (imported only where one is built);
`mosaic` the Pallas Mosaic GPU tile math and kernels; `tile_codec` what a kernel that moves
wire tiles itself asks of a codec (its family's tile codec, through its provider); `fused`
the one-launch all-reduce kernels that move wire tiles between devices themselves."""
