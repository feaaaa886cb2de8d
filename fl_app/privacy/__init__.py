"""The privacy core: mechanisms, calibration, events, composition, accounting, randomness.

* :mod:`~fl_app.privacy.mechanisms` - noise functions (explicit generator);
* :mod:`~fl_app.privacy.calibration` - privacy target -> noise parameter;
* :mod:`~fl_app.privacy.events` - what happened (one event per mechanism use per round);
* :mod:`~fl_app.privacy.composition` - how to account (RDP / PLD / basic);
* :mod:`~fl_app.privacy.accountant` - per-client composition of recorded events;
* :mod:`~fl_app.privacy.rng` - seeded or OS-entropy generators;
* :mod:`~fl_app.privacy.audit` - empirical privacy-loss estimates for tests;
* ``python -m fl_app.privacy`` - the budget calculator (:mod:`fl_app.report.calculator`, outside the core: it
  also computes the algorithms' own calibrations).
"""
