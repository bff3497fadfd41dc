// The viewer's JavaScript (attnlens/viewer/viewer.js), linted by `make lint`. ESLint's core rules only (no plugin or
// shared config to install), so `npx eslint` needs nothing beside itself: the recommended rules that can catch a
// mistake in a small browser script, and a few for legibility.
export default [
  {
    files: ["attnlens/viewer/**/*.js"],
    languageOptions: {
      ecmaVersion: 2022,
      sourceType: "script",
      // what the page's browser gives the script
      globals: {window: "readonly", document: "readonly", performance: "readonly", Option: "readonly", atob: "readonly"},
    },
    linterOptions: {reportUnusedDisableDirectives: "error"},
    rules: {
      "no-undef": "error", "no-unused-vars": "error", "no-redeclare": "error", "no-shadow-restricted-names": "error",
      "no-dupe-keys": "error", "no-duplicate-case": "error", "no-unreachable": "error", "no-self-assign": "error",
      "no-self-compare": "error", "no-constant-condition": "error", "no-cond-assign": "error",
      "no-fallthrough": "error", "no-empty": "error", "no-func-assign": "error", "no-const-assign": "error",
      "no-loss-of-precision": "error", "no-unsafe-negation": "error", "no-unused-expressions": "error",
      "no-use-before-define": ["error", {functions: false}], "use-isnan": "error", "valid-typeof": "error",
      "eqeqeq": "error", "no-var": "error", "prefer-const": "error", "strict": ["error", "function"],
      "no-implicit-globals": "error", "no-eval": "error", "no-implied-eval": "error", "no-new-func": "error",
    },
  },
];
