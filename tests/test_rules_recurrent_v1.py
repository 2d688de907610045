"""Weights read inside TF1 (v1) while frames on the rules (`pertower.rules._v1_loops`):
`tf.compat.v1.nn.dynamic_rnn` with LSTMCell, GRUCell and BasicRNNCell (sequence_length
given or not, batch- or time-major), a hand-written tf.while_loop over reference
variables, without batch_size, against the one-example loop; a frame the copy cannot
reproduce keeps its row passes. v1 control flow exists only under
tf.compat.v1.disable_v2_behavior(), so every check runs in the subprocess of
tests/scripts/recurrent_v1_checks.py ("recurrent_v1"; the longer matrix in
"recurrent_v1_heavy", read by heavy tests).
"""

import pytest

# the checks of the script (not imported here: it disables TF2 behavior on import)
FAST = ["check_lstm_with_lengths_time_major", "check_basic_rnn_cell",
        "check_hand_written_while_loop_on_reference_variables",
        "check_a_frame_drawing_random_numbers_keeps_row_passes"]
HEAVY = ["check_gru_with_lengths", "check_gru_time_major", "check_lstm",
         "check_basic_rnn_cell_with_lengths_time_major",
         "check_lstm_stopping_before_the_last_step"]


@pytest.mark.process_checks("recurrent_v1")
@pytest.mark.parametrize("check", FAST)
def test_v1_frames_on_the_rules(processes, check):
    processes.assert_passed("recurrent_v1", check)


@pytest.mark.heavy
@pytest.mark.process_checks("recurrent_v1_heavy")
@pytest.mark.parametrize("check", HEAVY)
def test_v1_frames_on_the_rules_heavy(processes, check):
    processes.assert_passed("recurrent_v1_heavy", check)
