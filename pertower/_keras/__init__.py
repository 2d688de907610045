"""What `pertower.keras` is built from: the Keras loss read back per example (`loss`), the
optimizers' DP state and apply step (`state`), Poisson batches for `fit` (`poisson`) and
the per-example scores callback (`callbacks`). Imports tf_keras: loaded only by
`pertower.keras`."""
