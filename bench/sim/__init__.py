"""The exact-gradient chain model behind ``bench.learning_sim``: items and their dynamics
(``model``), trees and predictors (``trees``), the methods and one run (``run``)."""
