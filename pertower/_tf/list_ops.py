"""TensorFlow's TensorList ops (tensorflow/python/ops/list_ops.py, gen_list_ops), by
name: the lists the loop backward and the loop copies carry per step. These wrappers
have no public module (their raw ops are `tf.raw_ops.TensorList*`); a name that moved
fails the import of `pertower._tf` with an ImportError naming it.
"""

# pylint: disable=no-name-in-module,unused-import
from tensorflow.python.ops.gen_list_ops import tensor_list_pop_back
from tensorflow.python.ops.list_ops import (empty_tensor_list, tensor_list_from_tensor,
                                            tensor_list_get_item, tensor_list_push_back,
                                            tensor_list_reserve, tensor_list_set_item,
                                            tensor_list_stack)

__all__ = ["empty_tensor_list", "tensor_list_from_tensor", "tensor_list_get_item",
           "tensor_list_pop_back", "tensor_list_push_back", "tensor_list_reserve",
           "tensor_list_set_item", "tensor_list_stack"]
