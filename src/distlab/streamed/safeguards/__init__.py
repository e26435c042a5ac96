"""The streamed step's guards, behind one door: what the step and its loss modules check, one entry per moment.

A guard in a distributed step must do more than raise: a rank that raises alone leaves the others waiting in
the next collective until the group's timeout. So each guard below either needs no exchange (every rank sees
the same numbers) or exchanges a few numbers first and lets every rank judge the same table
(`distlab.comm.agree`): the same error on every rank, before a collective can hang.

around the call        `guarded_step(model)`: a peer that dies in an exchange is named on the survivors (`peers`),
                       and every error ends with how to exit cleanly (`exit_hint`; a loss module: `hinting_release`)
before phase 1         `ready_step`: the config, the wrapper, the batch, agreed across ranks, or one error (`step_call`)
phase 1                `Ready.agreed_outputs`: the forward's outputs checked and agreed (`step_call`)
after phase 2          `loss_not_finite`: a non-finite global loss stops the step before any backward, naming the
                       ranks whose embeddings were not finite (`embeddings_not_finite`; `finite`)
after phase 5          `agree_gradients_finite`: a non-finite gradient on any rank stops the optimizer (`finite`)
a loss module's call   `agree(call, local_problem(...))`: its features, scale and settings agreed (`loss_call`)

One job a module:
  `step_call`   the step's call: a step every rank agreed to run, or the same error on every rank
  `finite`      a non-finite loss or gradient never reaches the parameters
  `peers`       a rank that dies mid-step, named on the survivors by a heartbeat in the store
  `exit_hint`   every error of the step and the loss modules ends with how to exit cleanly
  `loss_call`   a loss module's call, checked and agreed across ranks
"""

from distlab.streamed.safeguards.exit_hint import hinting_release, with_hint
from distlab.streamed.safeguards.finite import agree_gradients_finite, embeddings_not_finite, loss_not_finite
from distlab.streamed.safeguards.loss_call import Call, agree, as_number, local_problem
from distlab.streamed.safeguards.step_call import Outputs, Ready, as_outputs, guarded_step, ready_step

__all__ = [
    "Call",
    "Outputs",
    "Ready",
    "agree",
    "agree_gradients_finite",
    "as_number",
    "as_outputs",
    "embeddings_not_finite",
    "guarded_step",
    "hinting_release",
    "local_problem",
    "loss_not_finite",
    "ready_step",
    "with_hint",
]
