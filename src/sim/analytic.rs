//! The analytic write amplification of uniform random overwrites (Desnoyers, SYSTOR'12 / TOS'14;
//! Hu et al., SYSTOR'09): with FIFO cleaning, or greedy cleaning and large erase units, the
//! valid fraction δ of the victim solves δ = e^{−α(1−δ)}, where α = physical / logical space,
//! and WAF = 1 / (1 − δ). In closed form δ = −W₀(−α e^{−α}) / α (Lambert W).
//!
//! The simulator is validated against these numbers (`sim::tests::validation_*`).

/// The victim's valid fraction δ for space ratio `alpha` = physical / logical, i.e. the root in
/// [0, 1) of δ = e^{−α(1−δ)}. Returns 1.0 (no free space, no progress) for `alpha` ≤ 1 and NaN
/// for NaN.
pub fn valid_fraction(alpha: f64) -> f64 {
    if alpha.is_nan() {
        return f64::NAN;
    }
    if alpha <= 1.0 {
        return 1.0;
    }
    // f(δ) = δ − e^{−α(1−δ)} is concave with roots δ* < 1 and 1; f(0) < 0. Newton's method from
    // 0 climbs monotonically to δ* (a tangent of a concave function lies above it), so it
    // never jumps to the trivial root 1. δ = 1 − ln(α)/α is where f peaks; δ* lies left of it.
    let mut d = 0.0f64;
    for _ in 0..200 {
        let e = (-alpha * (1.0 - d)).exp();
        let f = d - e;
        let df = 1.0 - alpha * e;
        if df <= 0.0 {
            break; // cannot happen left of the peak; guards against α so close to 1 that it rounds
        }
        let next = d - f / df;
        if (next - d).abs() <= 1e-15 {
            return next;
        }
        d = next;
    }
    d
}

/// WAF = 1 / (1 − δ) for space ratio `alpha` = physical / logical. Infinite for `alpha` ≤ 1.
pub fn analytic_waf_alpha(alpha: f64) -> f64 {
    let d = valid_fraction(alpha);
    if d >= 1.0 {
        f64::INFINITY
    } else {
        1.0 / (1.0 - d)
    }
}

/// WAF of uniform random overwrites of the whole logical space when over-provisioning is
/// `op_fraction_of_physical` = (physical − logical) / physical, e.g. 0.07 → 7.32, 0.20 → 2.69.
/// Outside [0, 1) the answer is NaN; 0 gives infinity.
pub fn analytic_waf_uniform(op_fraction_of_physical: f64) -> f64 {
    let op = op_fraction_of_physical;
    if !(0.0..1.0).contains(&op) {
        return f64::NAN;
    }
    analytic_waf_alpha(1.0 / (1.0 - op))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_reference_table() {
        // Section 6 of the FDP reference: OP as a fraction of physical space → WAF.
        for (op, waf) in [(0.07, 7.32), (0.125, 4.18), (0.20, 2.69), (0.28, 1.99), (0.50, 1.26)] {
            let got = analytic_waf_uniform(op);
            assert!((got - waf).abs() < 0.006, "op {op}: {got} vs {waf}");
        }
    }

    #[test]
    fn matches_vendor_op_with_utilisation_table() {
        // α = (1 + op) / u, from the same section.
        for (op, u, waf) in [(0.07, 1.0, 7.82), (0.07, 0.9, 3.33), (0.20, 0.8, 1.72), (0.28, 0.5, 1.11)] {
            let got = analytic_waf_alpha((1.0 + op) / u);
            assert!((got - waf).abs() < 0.006, "op {op} u {u}: {got} vs {waf}");
        }
    }

    #[test]
    fn root_solves_the_equation_and_edges_are_defined() {
        for alpha in [1.0001, 1.01, 1.075, 1.5, 2.0, 5.0, 50.0] {
            let d = valid_fraction(alpha);
            assert!((0.0..1.0).contains(&d), "alpha {alpha}: {d}");
            assert!((d - (-alpha * (1.0 - d)).exp()).abs() < 1e-12, "alpha {alpha}: residual");
        }
        assert_eq!(analytic_waf_alpha(1.0), f64::INFINITY);
        assert_eq!(analytic_waf_alpha(0.5), f64::INFINITY);
        assert_eq!(analytic_waf_uniform(0.0), f64::INFINITY);
        assert!(analytic_waf_uniform(1.0).is_nan());
        assert!(analytic_waf_uniform(-0.1).is_nan());
        assert!(analytic_waf_alpha(f64::NAN).is_nan());
        // Lots of spare space: the victim is nearly empty.
        assert!((analytic_waf_alpha(50.0) - 1.0).abs() < 1e-9);
    }
}
