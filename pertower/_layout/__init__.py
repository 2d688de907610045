"""The row and shape vocabulary shared by the rules and the convolution machinery
(private): `_rows` (example rows, groups, dense per-example products) and `_shapes`
(shared constants, static reshape targets, strided slices)."""
