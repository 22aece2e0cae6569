// A per-byte reference converter built only from the definitions in layout_math.h
// (HopperStorageWord, HopperValuePosition, BlackwellStorageByte, BlackwellOffset,
// HopperScaleSource, BlackwellScaleSource, Packing1Nibble / Packing2Nibble): each output
// byte is computed on its own, with none of the engines' word-level forms or tiles.
// Slow (a few MB/s); for tests. The golden tests check it against every reference vector,
// so the engines can then be checked against it on shapes and views the vectors lack.
#ifndef WPREP_TESTS_SUPPORT_REFERENCE_H_
#define WPREP_TESTS_SUPPORT_REFERENCE_H_

#include <cstdint>
#include <vector>

#include "wprep/kernels/plan.h"

namespace wprep::testing {

// The output of `plan` for `input` (the plan's input view: plan.input_strides over
// input's bytes), plan.output_bytes long. It reads the plan's spec, shapes and strides,
// and none of its Geometry.
std::vector<uint8_t> ReferenceConvert(const Plan& plan, const std::vector<uint8_t>& input);

}  // namespace wprep::testing

#endif  // WPREP_TESTS_SUPPORT_REFERENCE_H_
