"""The exact-gradient chain model behind ``bench.learning_sim``: items and their dynamics
(``model``), trees and predictors (``trees``), the methods, one run and one seed of every method
(``run``).

The model (``--structure chain``). An item is an H-hop relation chain (H drawn from ``--hops``);
each hop carries a hazard with the item's rate h ~ Beta(``--hazard-a``, ``--hazard-b``): an alias
with probability ``--alias-share`` (recoverable: the verbatim query fails and a retry costs a turn)
or else a homonym (two near-duplicate names; taking the first match silently derails the chain when
the first match is the wrong copy, a hidden coin fixed in the item). Hazards are fixed in the item,
so they recur each time the prompt does. The turn cap is H + 3 (the answer takes a turn). Each turn
the policy picks one of three actions by a softmax over logits shared across items by turn type:

    plain   (a hop, no known hazard) correct query (advances; at an alias hop it fails and the
                                     next turn is a retry), sloppy query (no progress), answer now (r = 0)
    retry   (an alias query failed)  query the alias (advances), repeat verbatim (no progress), answer now
    homonym (two near-duplicates)    verify (advances), take the first match (advances, derails if
                                     the first match is the wrong copy), answer now
    answer  (all hops found)         answer (r = 1 unless derailed), search again, answer another entity

Transitions are deterministic given the item, so a prefix's state (hop, retry flag, derailed,
turn) fixes its exact value V(H) = P(r = 1 | H), which the oracle reads. Visible text cues (what the
learned predictor may read): H, and per item the count of shown alias cues (hyphenated names) and
shown homonym cues (near-duplicate names); each hazard shows its cue with probability
``--cue-rate`` and a hazard-free hop shows a false one with probability 0.1.

``--structure arith`` (negative control): every item is one homonym hop whose first match is wrong,
then the answer: the first turn decides the outcome and all prompts are alike, so there is nothing
for an allocator to target (the chain options are ignored).

A step, for every method on the same candidate pool (``--pool-size`` prompts of a
``--train-items`` train pool taken in shuffled epochs, so a prompt recurs every
train_items / pool_size steps): the method's allocator spends the leaf budget (M (1 + N) leaves,
M = root_budget), rollouts are sampled from the current policy (from the root or, for Stage 2, from
the stored prefix's state), each tree's advantages come from the configured estimator, and the
estimated gradient sum_paths sum_turns A * grad log pi(turn), averaged over the batch's turns (the
loss's token-mean with one cost per turn), takes one Adam step (AdamW as in the pipeline, no decay).

Predictors: ``learned`` is a weighted logistic regression on the visible features of a history
(the cues above, and for a prefix its turn, hops found, the retry flag and how many first matches
were taken), fit after each step on the backed-up values of the last ``REPLAY_STEPS`` steps'
nodes (weights n_y), as ``HashedNgramPredictor`` is; like hashed n-grams it cannot learn an
item's hidden hazards. ``oracle`` is the exact V. ``constant`` predicts the last step's mean
reward everywhere. ``posterior`` scores roots by ``trace_core.posterior.PromptPosterior`` (counts
from each prompt's rollouts from the root, shrunk to the learned predictor's estimate) and
prefixes by the learned predictor.

Departures: a tabular policy stands in for the LM, and one action per turn for a turn's tokens;
the PPO clip is not modelled (one gradient step per batch, so every ratio is 1).
"""
