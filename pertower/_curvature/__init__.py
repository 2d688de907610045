"""Curvature from backpropagated columns: the loss Hessian's factor S, the output
gradients of its columns, and the quantities built from them (the sum of squared
gradients, the generalized Gauss-Newton diagonal)."""
